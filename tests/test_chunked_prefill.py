"""Chunked prefill (--max-num-batched-tokens): prompts longer than a step's budget are
prefilled in pieces over several steps while the running sequences keep decoding.

Greedy output must equal a run that prefills whole prompts, token for token, in ar (an
in-process TargetWorker), sd and ssd (the real runtime), with prefix caching on and off
and under preemption; the stats show that prompts were chunked and that no step computed
more tokens than the budget.
"""

from __future__ import annotations

import numpy as np
import pytest

from collections import deque

from e2e_util import make_config
from protocol.messages import GenerateRequest, SamplingParams, TokenOutputs
from spec_runtime.client import Client
from spec_runtime.config import RuntimeConfig, SchedulerConfig
from spec_runtime.engine.kv_blocks import KVBlocks, block_hash
from target_proc.kv_schedule import KVScheduler
from target_proc.sequence import Sequence
from test_paged_serving import BS, GREEDY, MAX_LEN, _run, _stats, _worker

BUDGET = 16


def _long_prompts(num: int, seed: int, shared: int = 0) -> list[list[int]]:
    """Prompts of 30-60 tokens (2-4 budgets), the first `shared` tokens common to all."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 300, shared).tolist()
    return [system + rng.integers(3, 300, int(rng.integers(30, 61)) - shared).tolist() for _ in range(num)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_ar_greedy_with_chunked_prefill_equals_whole_prompts(tiny_pair, prefix_caching):
    prompts = _long_prompts(6, seed=0, shared=24 if prefix_caching else 0)
    whole, whole_clients = _worker(tiny_pair.target, prefix_caching=False, max_batch_size=3)
    want = _run(whole, whole_clients, prompts, 12)
    assert _stats(whole, whole_clients).num_prefill_chunks == 0

    chunked, clients = _worker(tiny_pair.target, prefix_caching=prefix_caching, max_batch_size=3,
                               max_num_batched_tokens=BUDGET)
    # The first request alone, so with prefix caching the rest find the shared part cached.
    got = _run(chunked, clients, prompts[:1], 12)
    rest = _run(chunked, clients, prompts[1:], 12)
    assert [got["0"]] + [rest[str(i)] for i in range(5)] == [want[str(i)] for i in range(6)]
    st = _stats(chunked, clients)
    assert st.num_prefill_chunks >= 6  # every prompt is longer than the budget
    assert 0 < st.max_step_tokens <= BUDGET
    assert (st.prefix_cache_hits > 0) == prefix_caching
    assert st.num_free_kv_blocks == st.num_kv_blocks


def test_running_sequences_decode_while_a_long_prompt_is_chunked(tiny_pair):
    """Two short requests decode; a long one arrives and takes several steps to prefill;
    the short ones gain a token in each of those steps."""
    worker, clients = _worker(tiny_pair.target, max_batch_size=3, max_num_batched_tokens=BUDGET)
    rng = np.random.default_rng(1)
    short = [rng.integers(3, 300, 5).tolist() for _ in range(2)]
    long = rng.integers(3, 300, 100).tolist()
    for rid, p, n in (("s0", short[0], 40), ("s1", short[1], 40)):
        clients.inbox.append((b"c", GenerateRequest(request_id=rid, prompt_token_ids=np.asarray(p),
                                                    sampling=SamplingParams(max_tokens=n, **GREEDY))))
    worker.poll_clients(block=False)
    worker.admit()
    worker.step()
    clients.inbox.append((b"c", GenerateRequest(request_id="long", prompt_token_ids=np.asarray(long),
                                                sampling=SamplingParams(max_tokens=4, **GREEDY))))
    worker.poll_clients(block=False)
    steps_prefilling = 0
    while worker.waiting:
        before = [s.num_tokens for s in worker.running.values()]
        worker.admit()
        worker.step()
        steps_prefilling += 1
        assert all(s.num_tokens == b + 1 for s, b in zip(list(worker.running.values())[:2], before))
    # 100 tokens at most 16 - 2 running verifies - 1 (its own first verify) per step.
    assert steps_prefilling >= 100 // BUDGET
    assert _stats(worker, clients).max_step_tokens <= BUDGET


def test_greedy_with_chunked_prefill_and_preemption_equals_whole_prompts(tiny_pair):
    prompts = _long_prompts(6, seed=2, shared=20)
    tight, clients = _worker(tiny_pair.target, num_kv_blocks=30, max_batch_size=3, max_num_batched_tokens=BUDGET)
    got = _run(tight, clients, prompts, 40)
    st = _stats(tight, clients)
    assert st.num_preemptions > 0 and st.num_prefill_chunks > 0
    assert st.max_step_tokens <= BUDGET
    assert st.num_free_kv_blocks == st.num_kv_blocks == 30
    assert not tight.sched.prefilled and not tight.kv.tables
    whole, whole_clients = _worker(tiny_pair.target, prefix_caching=False, max_batch_size=3)
    assert got == _run(whole, whole_clients, prompts, 40)


def _prompt_logprobs(worker, clients, prompt) -> object:
    clients.inbox.append((b"c", GenerateRequest(request_id="p", prompt_token_ids=np.asarray(prompt),
                                                sampling=SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))))
    outs = []
    while not any(o.finished for o in outs):
        worker.poll_clients(block=False)
        worker.admit()
        if worker.running:
            worker.step()
        worker.flush_outputs()
        outs += [o for m in clients.sent if isinstance(m, TokenOutputs) for o in m.outputs]
        clients.sent.clear()
    [first] = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    return first


def test_prompt_logprobs_are_gathered_piece_by_piece(tiny_pair):
    prompt = _long_prompts(1, seed=8)[0]
    whole, whole_clients = _worker(tiny_pair.target, max_batch_size=3)
    want = _prompt_logprobs(whole, whole_clients, prompt)
    chunked, clients = _worker(tiny_pair.target, max_batch_size=3, max_num_batched_tokens=BUDGET)
    got = _prompt_logprobs(chunked, clients, prompt)
    st = _stats(chunked, clients)
    assert st.num_prefill_chunks >= 2 and st.max_step_tokens <= BUDGET
    assert len(got.logprobs) == len(prompt) - 1
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got.ranks == want.ranks and got.top_token_ids == want.top_token_ids


def _seq(seq_id: int, num_tokens: int) -> Sequence:
    first = 3 + 100 * seq_id  # no prefix in common
    return Sequence(seq_id=seq_id, request_id=str(seq_id), client=b"c", prompt_token_ids=list(range(first, first + num_tokens)),
                    sampling=SamplingParams(max_tokens=64, **GREEDY), seed=0)


def test_a_prefill_in_chunks_gives_its_blocks_back_first_when_the_pool_runs_short():
    """Pool of 17 blocks of 4: a running sequence holds 6, a 40-token prompt gets its
    first piece (and its 10 blocks, leaving the one admission keeps spare); the running
    one then needs two more. The prefill
    is the newest holder: it gives its blocks back (its computed full blocks stay cached)
    and starts over later; the running sequence is not preempted."""
    kv = KVBlocks(17, BS)
    sched = KVScheduler(kv, k=0, max_model_len=MAX_LEN, max_num_seqs=2, budget=8)
    running: dict = {}
    waiting = deque([_seq(0, 21)])
    steps = 0
    while waiting:  # 21 tokens at 8 a step, the last piece with its own first verify
        sched.admit(waiting, running)
        steps += 1
    assert steps == 3 and sched.num_prefill_chunks == 2
    for t in range(3):  # decode to 24 tokens: 6 blocks
        running[0].token_ids.append(7)
        assert sched.reserve(running, waiting) == []
        sched.commit(running[0])
    waiting.append(_seq(1, 40))
    adm = sched.admit(waiting, running)
    assert adm.new == [] and [len(it.token_ids) for it in adm.items] == [8 - 1]  # 8 minus 0's verify
    assert sched.prefilled == {1: 7} and len(kv.tables[1]) == 10 and kv.num_free_blocks == 1
    running[0].token_ids += [7] * 5  # 29 tokens: 8 blocks
    assert sched.reserve(running, waiting) == []
    assert list(running) == [0] and [s.seq_id for s in waiting] == [1]
    assert 1 not in kv.tables and not sched.prefilled and sched.num_preemptions == 1
    assert waiting[0].stats.num_preemptions == 1 and len(kv.tables[0]) == 8
    # Its first piece (7 tokens: one full block) is found cached when it comes back.
    assert len(kv.pool.lookup([block_hash(b"", waiting[0].token_ids[:BS])])) == 1


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_speculative_greedy_with_chunked_prefill_equals_whole_prompt_ar(tiny_pair, mode):
    target, draft = tiny_pair
    prompts = _long_prompts(5, seed=3, shared=16)
    whole, whole_clients = _worker(target, prefix_caching=False, max_batch_size=3)
    want = _run(whole, whole_clients, prompts, 16)
    cfg = make_config(target, draft, mode=mode, k=3)
    # 3 running sequences x (K + 1) = 12 verify tokens: 4 left for prefill pieces. The pool
    # (30 blocks of 4) is tight enough to preempt; that is not asserted, since how fast the
    # sequences grow depends on the draft's answers (SSD's cache hits on timing).
    cfg = cfg.replace(sched=SchedulerConfig(max_batch_size=3, max_model_len=MAX_LEN, block_size=BS, num_kv_blocks=30,
                                            max_num_batched_tokens=BUDGET, spec_policy="always"))
    with Client(cfg) as client:
        sp = SamplingParams(max_tokens=16, **GREEDY)
        rids = [client.submit(p, sp) for p in prompts]
        got = [list(client._collect(rid).token_ids) for rid in rids]
        st = client.engine_stats()
    assert got == [want[str(i)] for i in range(len(prompts))]
    assert st.num_prefill_chunks >= len(prompts)
    assert 0 < st.max_step_tokens <= BUDGET
    assert st.num_free_kv_blocks == st.num_kv_blocks


def test_bad_budgets_are_refused_at_config_time():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 0"):
        SchedulerConfig(max_num_batched_tokens=-1)
    with pytest.raises(ValueError, match=r"max_num_seqs x \(K \+ 1\) = 8 x 5 = 40"):
        RuntimeConfig(sched=SchedulerConfig(max_batch_size=8, max_model_len=4096, max_num_batched_tokens=16))
    # 0, or a budget of the context length or more, prefills whole prompts: nothing to check.
    RuntimeConfig(sched=SchedulerConfig(max_batch_size=8, max_model_len=4096, max_num_batched_tokens=0))
    RuntimeConfig(sched=SchedulerConfig(max_batch_size=8, max_model_len=16, max_num_batched_tokens=16))
