"""The draft's paged KV (draft_proc/kv.py): block tables, prefix caching across requests,
no leaked blocks, and a pool too small for the batch, which must cost speed only."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest

from draft_proc.factory import make_speculators
from draft_proc.kv import DraftKV
from draft_proc.worker import DraftWorker
from e2e_util import make_config, random_prompts
from protocol import messages as m
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig
from spec_runtime.engine.forward_batch import PagedLayout
from test_ssd_prefetch import MemoryChannel

K = 3
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _worker(model_dir: str, mode: str = "sd", **sched):
    cfg = make_config(model_dir, model_dir, mode=mode, k=K)
    if sched:
        cfg = dataclasses.replace(cfg, sched=dataclasses.replace(cfg.sched, **sched))
    speculator, ssd, vocab, info = make_speculators(cfg)
    chan = MemoryChannel()
    num_seqs = cfg.sched.max_draft_seqs or cfg.sched.max_batch_size
    return DraftWorker(cfg, chan, speculator, vocab, num_seqs, ssd=ssd, kv=info["kv"]), chan


def _add(worker, chan, sid: int, prompt: list[int]) -> None:
    chan.inbox.append(m.AddSequence(seq_id=sid, prompt_token_ids=np.array(prompt, np.int64), seed=sid))
    while chan.inbox:
        worker.run_once()


def _round(worker, chan, step: int, outcomes: list[tuple[int, int, int, int]]):
    """outcomes: (seq_id, round, num_accepted, token_id); returns what the draft sent."""
    seqs = [worker.seqs[sid] for sid, *_ in outcomes if sid in worker.seqs]
    lens = {s.seq_id: s.num_tokens for s in seqs}
    chan.inbox.append(m.SpecRequest(
        step=step, seq_ids=np.array([o[0] for o in outcomes], np.int64), rounds=np.array([o[1] for o in outcomes]),
        num_accepted=np.array([o[2] for o in outcomes], np.int32), token_ids=np.array([o[3] for o in outcomes]),
        seq_lens=np.array([lens.get(o[0], 0) + o[2] + 1 for o in outcomes], np.int64), k=K))
    while chan.inbox:
        worker.run_once()
    sent, chan.sent[:] = list(chan.sent), []
    return sent


def test_a_shared_prefix_is_prefilled_once_and_speculates_the_same(tiny_llama_dir):
    worker, chan = _worker(tiny_llama_dir)
    kv = worker.kv
    system = list(range(10, 10 + 3 * 16 + 5))  # three full blocks and a bit
    _add(worker, chan, 1, system + [200, 201])
    (resp,) = _round(worker, chan, 1, [(1, 1, 0, 7)])  # first outcome: blocks of 1 get named
    assert isinstance(resp, m.SpecResponse)
    queries, hits = kv.counters()
    assert hits == 0 and queries == len(system) + 2
    _add(worker, chan, 2, system + [300, 301])
    seq2 = worker.seqs[2]
    assert seq2.num_cached == 3 * 16 and kv.counters()[1] == 3 * 16
    assert kv.blocks.tables[2][:3] == kv.blocks.tables[1][:3]  # the same blocks, shared
    # The speculation from the cached prefix equals a cold draft's.
    (warm,) = _round(worker, chan, 2, [(2, 1, 0, 9)])
    cold_worker, cold_chan = _worker(tiny_llama_dir, enable_prefix_caching=False)
    _add(cold_worker, cold_chan, 2, system + [300, 301])
    (cold,) = _round(cold_worker, cold_chan, 1, [(2, 1, 0, 9)])
    np.testing.assert_array_equal(warm.draft_token_ids, cold.draft_token_ids)
    assert cold_worker.kv.counters() == (0, 0)
    st = worker.stats()
    assert st.prefix_cache_hits == 3 * 16 and st.num_kv_blocks == kv.blocks.num_blocks


def test_blocks_return_after_many_adds_rounds_and_releases(tiny_llama_dir):
    worker, chan = _worker(tiny_llama_dir, max_batch_size=6)
    kv = worker.kv
    start = kv.num_free_blocks
    rng = random.Random(0)
    live: dict[int, int] = {}  # seq_id -> round
    step = 0
    for sid in range(1, 200):
        _add(worker, chan, sid, [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))])
        live[sid] = 0
        if rng.random() < 0.6 and live:
            step += 1
            outs = [(s, live[s] + 1, 0, rng.randrange(3, 300)) for s in list(live)[:4]]
            for s, r, *_ in outs:
                live[s] = r
            _round(worker, chan, step, outs)
        while len(live) > 4 or (live and rng.random() < 0.3):
            gone = rng.choice(list(live))
            chan.inbox.append(m.Release(seq_ids=np.array([gone], np.int64)))
            worker.run_once()
            del live[gone]
    chan.inbox.append(m.Release(seq_ids=np.array(list(live), np.int64)))
    worker.run_once()
    assert not worker.seqs and not kv.blocks.tables
    assert kv.num_free_blocks == start and sorted(kv._free_indices) == list(range(kv.max_seqs))


def test_a_pool_too_small_refuses_by_sequence_and_the_rest_go_on(tiny_llama_dir):
    worker, chan = _worker(tiny_llama_dir)
    # Four blocks of the runner's pool: room for one 50-token sequence (plus K + 1 rows).
    small = DraftKV(PagedLayout(4, 16, 256), K, 3)
    worker.kv = worker.speculator.kv = small
    _add(worker, chan, 1, list(range(3, 53)))
    assert small.num_free_blocks == 0
    chan.inbox.append(m.AddSequence(seq_id=2, prompt_token_ids=np.array([5, 6, 7], np.int64)))
    worker.run_once()
    (err,) = chan.sent
    chan.sent.clear()
    assert isinstance(err, m.ErrorReply) and err.code == "no_kv" and err.seq_id == 2 and 2 not in worker.seqs
    (resp,) = _round(worker, chan, 1, [(1, 1, 0, 9)])
    assert isinstance(resp, m.SpecResponse) and resp.num_draft_tokens.tolist() == [K]
    # Growing past the pool drops the sequence with no_kv too, and frees what it held.
    for r in range(2, 10):
        sent = _round(worker, chan, r, [(1, r, K, 9)])  # all K accepted: 4 tokens a round
        if 1 not in worker.seqs:
            break
    assert [x.code for x in sent] == ["no_kv"] and small.num_free_blocks == 4 and worker.num_no_kv == 2


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_with_draft_prefix_hits_and_a_small_draft_pool_equals_ar(tiny_pair, ar_reference, mode):
    """Requests sharing a long prefix, more of them than the draft holds: greedy output
    equals AR, the draft's prefix cache hits, and the refused sequences decode anyway."""
    target, draft = tiny_pair
    prefix = random_prompts(384, lengths=(40,), seed=3)[0]
    prompts = [prefix + p for p in random_prompts(384, lengths=(5, 9, 3, 7, 6), seed=4)]
    ar = ar_reference(target, prompts, GREEDY.max_tokens)
    cfg = make_config(target, draft, mode=mode, k=K)
    cfg = dataclasses.replace(cfg, sched=SchedulerConfig(max_batch_size=5, max_draft_seqs=3, max_model_len=256,
                                                         spec_policy="always"))
    with Client(cfg) as client:
        first = client.generate(prompts[0], GREEDY)
        rest = client.generate_batch(prompts[1:], GREEDY)
        deadline = time.monotonic() + 10.0  # the draft pushes its counters when it goes idle
        while (stats := client.engine_stats()).draft_prefix_cache_hits == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert [first.token_ids] + [r.token_ids for r in rest] == ar
    assert stats.draft_prefix_cache_hits >= 2 * 16, stats
    assert stats.totals.num_draft_tokens > 0


def test_a_slow_message_is_logged_at_debug_with_its_time(tiny_llama_dir, caplog, monkeypatch):
    """A stall of the draft shows in the target only as a long wait: the draft names the
    message that took long (over SLOW_S), and only at DEBUG."""
    import logging

    import draft_proc.worker as dw

    worker, chan = _worker(tiny_llama_dir)
    handle = worker.handle
    monkeypatch.setattr(worker, "handle", lambda msg: (time.sleep(dw.SLOW_S + 0.02), handle(msg)))
    with caplog.at_level(logging.INFO, logger="draft_proc.worker"):
        _add(worker, chan, 1, [5, 6, 7])
    assert "handled AddSequence" not in caplog.text
    with caplog.at_level(logging.DEBUG, logger="draft_proc.worker"):
        _add(worker, chan, 2, [5, 6, 8])
    assert "handled AddSequence in" in caplog.text
