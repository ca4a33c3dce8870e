"""The target's paged KV in serving: prefix-cache hits, preemption and block accounting.

In-process tests drive a TargetWorker (AR mode, no draft) over a tiny random llama
through a stand-in client channel, so a thousand requests take seconds. The SD and SSD
tests start the real runtime (target and draft processes) with a pool small enough to
preempt, and compare with a cold AR run token for token.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from e2e_util import make_config
from protocol.messages import AbortRequest, ErrorReply, GenerateRequest, SamplingParams, StatsRequest, TokenOutputs
from spec_runtime.client import Client
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from target_proc.model import target_runner
from target_proc.worker import TargetWorker

BS = 4  # tokens per KV block in these tests
MAX_LEN = 128
GREEDY = dict(temperature=0.0, ignore_eos=True)


class _Clients:
    """The client channel as TargetWorker uses it: an inbox, and what was sent."""

    def __init__(self) -> None:
        self.inbox: deque = deque()
        self.sent: list = []

    def recv(self, timeout_s: float):
        return self.inbox.popleft() if self.inbox else None

    def send_to(self, ident, msg) -> bool:
        self.sent.append(msg)
        return True

    def send_error_to(self, ident, code, message, request_id="") -> None:
        self.sent.append(ErrorReply(code=code, message=message, request_id=request_id))


_RUNNERS: dict = {}


def _worker(target: str, *, num_kv_blocks: int = 0, prefix_caching: bool = True, max_batch_size: int = 4,
            max_num_batched_tokens: int = 0):
    cfg = RuntimeConfig(target=ModelConfig(path=target), spec=SpeculativeConfig(mode="ar"),
                        sched=SchedulerConfig(max_batch_size=max_batch_size, max_model_len=MAX_LEN, block_size=BS,
                                              num_kv_blocks=num_kv_blocks, enable_prefix_caching=prefix_caching,
                                              max_num_batched_tokens=max_num_batched_tokens))
    # One runner per pool shape; a fresh worker over it starts with every block free.
    key = (target, num_kv_blocks, max_batch_size)
    if key not in _RUNNERS:
        _RUNNERS[key] = target_runner(cfg)
    clients = _Clients()
    return TargetWorker(cfg, _RUNNERS[key], clients, None), clients


def _run(worker: TargetWorker, clients: _Clients, prompts, max_tokens: int, aborts=()) -> dict[str, list[int]]:
    """Submit prompts (request ids "0", "1", ...), serve until idle; abort request ids in
    `aborts` as soon as their first token is out. Returns each request's token ids."""
    for i, p in enumerate(prompts):
        clients.inbox.append((b"c", GenerateRequest(request_id=str(i), prompt_token_ids=np.asarray(p),
                                                    sampling=SamplingParams(max_tokens=max_tokens, **GREEDY))))
    out: dict[str, list[int]] = {}
    aborted: set[str] = set()
    while True:
        worker.poll_clients(block=False)
        worker.admit()
        if worker.running:
            worker.step()
        worker.flush_outputs()
        for msg in clients.sent:
            assert not isinstance(msg, ErrorReply), msg
            for o in msg.outputs if isinstance(msg, TokenOutputs) else ():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.request_id in aborts and o.request_id not in aborted:
                    aborted.add(o.request_id)
                    clients.inbox.append((b"c", AbortRequest(request_id=o.request_id)))
        clients.sent.clear()
        if not worker.running and not worker.waiting and not clients.inbox:
            return out


def _stats(worker, clients):
    worker.on_client_message(b"c", StatsRequest())
    return clients.sent.pop()


def _system_prompt_requests(vocab: int, num: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, 22).tolist()  # 5 full blocks + 2 tokens
    return [system + rng.integers(3, vocab, int(rng.integers(2, 9))).tolist() for _ in range(num)]


def test_prefix_cache_hits_across_requests_sharing_a_system_prompt(tiny_pair):
    worker, clients = _worker(tiny_pair.target)
    prompts = _system_prompt_requests(worker.runner.vocab_size, 4)
    first = _run(worker, clients, prompts[:1], 6)
    assert _stats(worker, clients).prefix_cache_hits == 0
    rest = _run(worker, clients, prompts[1:], 6)
    st = _stats(worker, clients)
    assert st.prefix_cache_hits == 3 * 20  # each of 3 requests finds the system prompt's 5 full blocks
    assert st.prefix_cache_queries == sum(map(len, prompts))
    assert st.num_free_kv_blocks == st.num_kv_blocks

    cold, cold_clients = _worker(tiny_pair.target, prefix_caching=False)
    want = _run(cold, cold_clients, prompts, 6)
    assert [first["0"]] + [rest[str(i)] for i in range(3)] == [want[str(i)] for i in range(4)]
    assert _stats(cold, cold_clients).prefix_cache_hits == 0


def test_requests_sharing_a_prompt_at_once_prefill_it_once(tiny_pair):
    """n > 1 sends n requests with one prompt at once: the first prefills it, the others
    wait one step and reuse its full blocks (7 before the last of 30 tokens)."""
    worker, clients = _worker(tiny_pair.target)
    prompt = np.random.default_rng(6).integers(3, 300, 30).tolist()
    got = _run(worker, clients, [prompt] * 4, 6)
    st = _stats(worker, clients)
    assert st.prefix_cache_hits == 3 * 28 and st.prefix_cache_queries == 4 * 30
    cold, cold_clients = _worker(tiny_pair.target, prefix_caching=False)
    want = _run(cold, cold_clients, [prompt], 6)["0"]
    assert [got[str(i)] for i in range(4)] == [want] * 4
    # Prompts sharing only a system prompt (5 full blocks) at once: the same.
    _run(worker, clients, _system_prompt_requests(worker.runner.vocab_size, 3, seed=7), 2)
    assert _stats(worker, clients).prefix_cache_hits - st.prefix_cache_hits == 2 * 20


def test_cached_tokens_reach_the_request_stats(tiny_pair):
    worker, clients = _worker(tiny_pair.target)
    prompts = _system_prompt_requests(worker.runner.vocab_size, 2, seed=1)
    _run(worker, clients, prompts[:1], 3)
    clients.inbox.append((b"c", GenerateRequest(request_id="x", prompt_token_ids=np.asarray(prompts[1]),
                                                sampling=SamplingParams(max_tokens=3, **GREEDY))))
    finals = []
    while not finals:
        worker.poll_clients(block=False)
        worker.admit()
        if worker.running:
            worker.step()
        worker.flush_outputs()
        finals = [o for m in clients.sent if isinstance(m, TokenOutputs) for o in m.outputs if o.finished]
    assert finals[0].stats.num_cached_tokens == 20


def test_prompt_logprobs_compute_every_prompt_position_despite_a_cached_prefix(tiny_pair):
    worker, clients = _worker(tiny_pair.target)
    prompt = _system_prompt_requests(worker.runner.vocab_size, 1, seed=5)[0]
    outs = []
    for rid, extra in (("a", {}), ("b", {"prompt_logprobs": 0}), ("c", {"prompt_logprobs": 0})):
        clients.inbox.append((b"c", GenerateRequest(request_id=rid, prompt_token_ids=np.asarray(prompt),
                                                    sampling=SamplingParams(max_tokens=2, **GREEDY, **extra))))
        while not any(o.finished for m in clients.sent if isinstance(m, TokenOutputs) for o in m.outputs):
            worker.poll_clients(block=False)
            worker.admit()
            if worker.running:
                worker.step()
            worker.flush_outputs()
        outs.append([o for m in clients.sent if isinstance(m, TokenOutputs) for o in m.outputs])
        clients.sent.clear()
    b, c = (next(o for o in out if o.prompt_logprobs is not None) for out in outs[1:])
    assert len(b.prompt_logprobs.logprobs) == len(prompt) - 1
    assert c.prompt_logprobs.logprobs == pytest.approx(b.prompt_logprobs.logprobs, abs=1e-5)
    assert [o.stats.num_cached_tokens for out in outs for o in out if o.finished] == [0, 0, 0]


def test_greedy_output_is_the_same_when_requests_are_preempted(tiny_pair):
    """A pool of 20 blocks (80 tokens) for 4 sequences growing to ~45 tokens each: the
    newest ones are preempted and recomputed, and every output equals a cold run's."""
    prompts = _system_prompt_requests(300, 6, seed=2)
    tight, clients = _worker(tiny_pair.target, num_kv_blocks=20)
    got = _run(tight, clients, prompts, 20)
    st = _stats(tight, clients)
    assert st.num_preemptions > 0
    assert st.num_free_kv_blocks == st.num_kv_blocks == 20
    cold, cold_clients = _worker(tiny_pair.target, prefix_caching=False)
    assert got == _run(cold, cold_clients, prompts, 20)


def test_no_block_leaks_after_1000_mixed_requests_with_aborts(tiny_pair):
    worker, clients = _worker(tiny_pair.target, num_kv_blocks=40, max_batch_size=8)
    initial = worker.kv.num_free_blocks
    rng = np.random.default_rng(3)
    system = rng.integers(3, 300, 9).tolist()
    prompts = [(system if i % 2 else []) + rng.integers(3, 300, int(rng.integers(1, 12))).tolist()
               for i in range(1000)]
    aborts = {str(i) for i in range(1000) if i % 7 == 3}
    for lo in range(0, 1000, 100):  # ids stay unique: _run numbers each batch from 0
        batch = _run(worker, clients, prompts[lo:lo + 100], int(rng.integers(1, 5)), aborts=aborts)
        assert len(batch) == 100
    st = _stats(worker, clients)
    assert worker.kv.num_free_blocks == initial == st.num_free_kv_blocks
    assert not worker.kv.tables and all(r == 0 for r in worker.kv.pool.ref_count)
    assert st.prefix_cache_hits > 0 and st.num_running == st.num_waiting == 0


def test_a_request_larger_than_the_pool_is_refused(tiny_pair):
    worker, clients = _worker(tiny_pair.target, num_kv_blocks=20)
    clients.inbox.append((b"c", GenerateRequest(request_id="big", prompt_token_ids=np.arange(3, 80),
                                                sampling=SamplingParams(max_tokens=8, **GREEDY))))
    worker.poll_clients(block=False)
    [err] = clients.sent
    assert isinstance(err, ErrorReply) and err.code == "bad_request" and "KV cache" in err.message
    assert not worker.waiting and not worker.running


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_speculative_greedy_with_prefix_hits_and_preemption_equals_cold_ar(tiny_pair, mode):
    target, draft = tiny_pair
    prompts = _system_prompt_requests(300, 6, seed=4)
    cold, cold_clients = _worker(target, prefix_caching=False)
    want = _run(cold, cold_clients, prompts, 16)
    cfg = make_config(target, draft, mode=mode, k=3)
    cfg = cfg.replace(sched=SchedulerConfig(max_batch_size=4, max_model_len=MAX_LEN, block_size=BS,
                                            num_kv_blocks=24, spec_policy="always"))
    with Client(cfg) as client:
        sp = SamplingParams(max_tokens=16, **GREEDY)
        # One request first, so the rest find the system prompt cached.
        got = [list(client.generate(prompts[0], sp).token_ids)]
        rids = [client.submit(p, sp) for p in prompts[1:]]
        got += [list(client._collect(rid).token_ids) for rid in rids]
        st = client.engine_stats()
    assert got == [want[str(i)] for i in range(len(prompts))]
    assert st.prefix_cache_hits >= 20 * (len(prompts) - 1)
    assert st.num_preemptions > 0
    assert st.num_free_kv_blocks == st.num_kv_blocks
