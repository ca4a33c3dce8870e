"""target_proc.outputs: per-round accounting, engine totals, and per-client output merging."""

from __future__ import annotations

import numpy as np

from protocol.messages import RequestOutput, RequestStats, add_totals
from target_proc.outputs import merge_outputs, record_round
from protocol.sparse_q import DraftTokens


def _stats(k: int = 3) -> RequestStats:
    return RequestStats(accepted_per_position=[0] * k, drafted_per_position=[0] * k)


def _spec(hit: bool) -> DraftTokens:
    return DraftTokens(np.zeros(3, dtype=np.int64), None, None, cache_hit=hit)


def test_record_round_counts_positions_hits_misses_and_fallbacks():
    st = _stats()
    record_round(st, 3, 1, _spec(True), ssd=True, speculating=True)  # hit, 1 of 3 accepted
    record_round(st, 2, 2, _spec(False), ssd=True, speculating=True)  # miss (a backup draft)
    record_round(st, 0, 0, None, ssd=True, speculating=True)  # nothing arrived: a fallback round
    record_round(st, 0, 0, None, ssd=True, speculating=False)  # a planned plain round
    assert (st.num_rounds, st.num_draft_tokens, st.num_accepted_tokens) == (4, 5, 3)
    assert st.drafted_per_position == [2, 2, 1] and st.accepted_per_position == [2, 1, 0]
    assert (st.num_cache_hits, st.num_cache_misses, st.num_ar_fallback_rounds) == (1, 1, 1)
    sd = _stats()
    record_round(sd, 3, 3, _spec(False), ssd=False, speculating=True)  # SD answers are no misses
    assert sd.num_cache_misses == 0 and sd.num_cache_hits == 0


def test_add_totals_sums_counters_and_positions():
    totals, a, b = _stats(), _stats(), _stats()
    record_round(a, 3, 2, _spec(True), ssd=True, speculating=True)
    record_round(b, 1, 0, _spec(False), ssd=True, speculating=True)
    a.num_prompt_tokens, b.num_generated_tokens = 7, 4
    add_totals(totals, a)
    add_totals(totals, b)
    assert (totals.num_rounds, totals.num_prompt_tokens, totals.num_generated_tokens) == (2, 7, 4)
    assert (totals.num_cache_hits, totals.num_cache_misses) == (1, 1)
    assert totals.drafted_per_position == [2, 1, 1] and totals.accepted_per_position == [1, 1, 0]


def test_merge_outputs_one_per_request_in_order():
    outs = [
        RequestOutput("a", [1], "x"),
        RequestOutput("b", [5], "y"),
        RequestOutput("a", [2, 3], "zz", finished=True, finish_reason="stop", stats=_stats()),
    ]
    merged = merge_outputs(outs)
    assert [o.request_id for o in merged] == ["a", "b"]
    a = merged[0]
    assert a.new_token_ids == [1, 2, 3] and a.text_delta == "xzz"
    assert a.finished and a.finish_reason == "stop" and a.stats is not None
    assert merged[1].new_token_ids == [5] and not merged[1].finished
