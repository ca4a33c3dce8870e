"""Per-request accounting and the messages that carry results to clients.

Pure bookkeeping over protocol structs, no torch: what one verify round adds to a
request's RequestStats, and how a step's outputs become one TokenOutputs message per
client (protocol.messages.add_totals adds finished requests into the engine totals).
"""

from __future__ import annotations

from protocol.messages import DraftStats, RequestOutput, RequestStats
from protocol.sparse_q import DraftTokens
from target_proc.sequence import Sequence


def draft_fields(ds: DraftStats | None, *, alive: bool = False, hits_by_depth=(), num_timeouts: int = 0,
                 timeout_s: float = 0.0) -> dict:
    """The draft's part of EngineStats: the counters it pushed last (ds; None: no draft,
    or none pushed yet) and the link's own."""
    return dict(
        draft_alive=alive,
        draft_num_seqs=ds.num_seqs if ds else -1,
        draft_num_cache_entries=ds.num_cache_entries if ds else -1,
        draft_answer_s=ds.answer_s if ds else 0.0,
        draft_num_answers=ds.num_answers if ds else 0,
        draft_tree_shrinks=ds.num_tree_shrinks if ds else 0,
        draft_tree_grows=ds.num_tree_grows if ds else 0,
        draft_prefix_cache_queries=ds.prefix_cache_queries if ds else 0,
        draft_prefix_cache_hits=ds.prefix_cache_hits if ds else 0,
        hits_by_depth=list(hits_by_depth),
        num_draft_timeouts=num_timeouts,
        draft_timeout_s=timeout_s,
    )


def record_round(st: RequestStats, num_draft: int, num_accepted: int, spec: DraftTokens | None, *,
                 ssd: bool, speculating: bool, sd_round: bool = False, plain: bool = False) -> None:
    """One verify round of a request: num_accepted of its num_draft tokens accepted.

    spec is the speculation the round verified (None: none arrived, a plain round);
    speculating says whether the step wanted one (a plain round then counts as a fallback);
    sd_round: an SSD-mode round the round policy ran as synchronous SD (its answer
    came from a chain drafted on request, which is no cache miss); plain: a round the
    policy ran without speculation in a speculative mode.
    """
    st.num_rounds += 1
    st.num_draft_tokens += num_draft
    st.num_accepted_tokens += num_accepted
    for pos in range(num_draft):
        st.drafted_per_position[pos] += 1
        if pos < num_accepted:
            st.accepted_per_position[pos] += 1
    if spec is not None:
        if spec.cache_hit:
            st.num_cache_hits += 1
        elif ssd and sd_round:
            st.num_sd_rounds += 1
        elif ssd:
            st.num_cache_misses += 1
    elif speculating:
        st.num_ar_fallback_rounds += 1
    elif plain:
        st.num_plain_rounds += 1


def take_output(seq: Sequence) -> RequestOutput | None:
    """What a sequence has to send since its last output (None: nothing); the final
    output, with the request's stats, goes out exactly once."""
    if seq.final_sent or (not seq.pending_token_ids and not seq.finished):
        return None
    out = RequestOutput(
        request_id=seq.request_id,
        new_token_ids=seq.pending_token_ids,
        text_delta=seq.take_text_delta(),
        finished=seq.finished,
        finish_reason=seq.finish_reason,
        logprobs=seq.pending_logprobs,
        stats=seq.stats if seq.finished else None,
        top_token_ids=seq.pending_top_ids,
        top_logprobs=seq.pending_top_logprobs,
        stop_reason=seq.stop_reason if seq.finished else None,
        prompt_logprobs=seq.prompt_logprobs,
    )
    seq.prompt_logprobs = None
    seq.pending_token_ids = []
    seq.pending_logprobs = []
    seq.pending_top_ids = []
    seq.pending_top_logprobs = []
    seq.final_sent = seq.finished
    return out


def merge_outputs(outs: list[RequestOutput]) -> list[RequestOutput]:
    """A client's outputs of one step, one per request (in first-seen order)."""
    seen: dict[str, RequestOutput] = {}
    merged: list[RequestOutput] = []
    for o in outs:
        prev = seen.get(o.request_id)
        if prev is None:
            seen[o.request_id] = o
            merged.append(o)
        else:
            prev.new_token_ids = prev.new_token_ids + o.new_token_ids
            prev.text_delta += o.text_delta
            prev.logprobs = prev.logprobs + o.logprobs
            prev.top_token_ids = prev.top_token_ids + o.top_token_ids
            prev.top_logprobs = prev.top_logprobs + o.top_logprobs
            prev.stop_reason = o.stop_reason if o.stop_reason is not None else prev.stop_reason
            prev.finished = prev.finished or o.finished
            prev.finish_reason = o.finish_reason or prev.finish_reason
            prev.stats = o.stats or prev.stats
            prev.prompt_logprobs = prev.prompt_logprobs or o.prompt_logprobs
    return merged
