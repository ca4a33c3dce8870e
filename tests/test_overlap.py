"""Plain steps queued ahead (target_proc/ahead.py): the next plain step's forward is queued
before the host reads this step's tokens. The output must be the same as with every step
synchronous, token for token, through stops, aborts, preemption, chunked prefill and
sampling; requests that need their tokens on the host first keep the steps synchronous.

In-process: a TargetWorker over a tiny random llama and a stand-in client channel.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from conftest import save_tiny_model

from protocol.messages import AbortRequest, ErrorReply, GenerateRequest, SamplingParams, TokenOutputs
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from target_proc.model import target_runner
from target_proc.no_draft import NoDraft
from target_proc.worker import TargetWorker
from test_paged_serving import _Clients

MAX_LEN = 96
_RUNNERS: dict = {}


def _worker(target: str, overlap: bool, *, mode: str = "ar", num_kv_blocks: int = 0, budget: int = 0,
            draft=None, device: str = "cpu", k: int = 2) -> tuple[TargetWorker, _Clients]:
    cfg = RuntimeConfig(target=ModelConfig(path=target, device=device, gpu_memory_utilization=0.3),
                        draft=ModelConfig(path=target, device=device),
                        spec=SpeculativeConfig(mode=mode, k=k),
                        sched=SchedulerConfig(max_batch_size=4, max_model_len=MAX_LEN, block_size=4,
                                              num_kv_blocks=num_kv_blocks, max_num_batched_tokens=budget,
                                              overlap_schedule="on" if overlap else "off"))
    key = (target, num_kv_blocks, device)
    if key not in _RUNNERS:
        _RUNNERS[key] = target_runner(cfg)
    clients = _Clients()
    return TargetWorker(cfg, _RUNNERS[key], clients, draft), clients


def _serve(worker: TargetWorker, clients: _Clients, requests: list[tuple[list[int], dict]], *, aborts=(),
           late: int = 0) -> tuple[dict, int]:
    """Serve `requests` (ids "0", "1", ...; the last `late` of them arrive after 5 steps)
    until idle, aborting the ids in `aborts` after their third token. Returns per request
    (token ids, finish reason, logprobs) and the steps that left a step queued ahead."""
    def submit(i):
        prompt, sp = requests[i]
        clients.inbox.append((b"c", GenerateRequest(request_id=str(i), prompt_token_ids=np.asarray(prompt),
                                                    sampling=SamplingParams(**sp))))

    for i in range(len(requests) - late):
        submit(i)
    out: dict[str, list] = {}
    aborted, steps, queued = set(), 0, 0
    while True:
        worker.poll_clients(block=False)
        worker.admit()
        if worker.running or worker._ahead:
            worker.step()
            steps += 1
            queued += worker._ahead is not None
        if steps == 5:
            for i in range(len(requests) - late, len(requests)):
                submit(i)
        worker.flush_outputs()
        for msg in clients.sent:
            assert not isinstance(msg, ErrorReply), msg
            for o in msg.outputs if isinstance(msg, TokenOutputs) else ():
                toks, _, lps = out.setdefault(o.request_id, [[], None, []])
                toks.extend(o.new_token_ids)
                lps.extend(zip(o.logprobs, o.top_token_ids or [()] * len(o.logprobs),
                               o.top_logprobs or [()] * len(o.logprobs)))
                if o.finished:
                    out[o.request_id][1] = o.finish_reason
                if o.request_id in aborts and len(toks) >= 3 and o.request_id not in aborted:
                    aborted.add(o.request_id)
                    clients.inbox.append((b"c", AbortRequest(request_id=o.request_id)))
        clients.sent.clear()
        if not worker.running and not worker.waiting and not clients.inbox and steps > 5:
            assert worker.kv.num_free_blocks == worker.kv.num_blocks
            return out, queued


def _prompts(num: int, seed: int, lo: int = 4, hi: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(lo, hi))).tolist() for _ in range(num)]


def _both(target, requests, **kw):
    """The same requests with overlap off, then on: (off, on, steps queued ahead with it on,
    the engine stats of the run with it on)."""
    serve_kw = {k: kw.pop(k) for k in ("aborts", "late") if k in kw}
    off, _ = _serve(*_worker(target, False, **kw), requests, **serve_kw)
    worker, clients = _worker(target, True, **kw)
    on, queued = _serve(worker, clients, requests, **serve_kw)
    return off, on, queued, worker.engine_stats()


def test_greedy_and_sampled_requests_with_stops_give_the_same_tokens(tiny_pair):
    """Stop tokens end some requests at a step queued ahead (its extra token is dropped);
    others end by max_tokens (left out of the next step); sampled ones use their seeds."""
    prompts = _prompts(6, seed=0)
    ref, _ = _serve(*_worker(tiny_pair.target, False), [(p, dict(max_tokens=20, temperature=0.0, ignore_eos=True))
                                                        for p in prompts])
    requests = []
    for i, p in enumerate(prompts):
        sp = dict(max_tokens=12 + 3 * i, temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=True)
        if i in (0, 2, 4):  # greedy: a token its greedy run produces mid-way stops it there
            sp["stop_token_ids"] = [ref[str(i)][0][5 + i]]
        requests.append((p, sp))
    off, on, queued, stats = _both(tiny_pair.target, requests)
    assert on == off
    assert queued > 20
    assert [off[str(i)][1] for i in range(6)] == ["stop", "length"] * 3


def test_aborts_preemption_and_chunked_prefill_give_the_same_tokens(tiny_pair):
    """A small pool preempts running requests while a step is queued ahead; long prompts
    arrive while others decode and prefill in pieces; two requests are aborted."""
    prompts = _prompts(7, seed=1, lo=10, hi=40)
    requests = [(p, dict(max_tokens=30, temperature=0.7 if i % 3 == 0 else 0.0, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]
    off, on, queued, stats = _both(tiny_pair.target, requests, num_kv_blocks=40, budget=24, aborts=("1", "4"),
                                   late=3)
    assert on == off
    assert queued > 20 and stats.num_preemptions > 0 and stats.num_prefill_chunks > 0
    assert off["1"][1] == off["4"][1] == "abort"


def test_logprobs_run_ahead_and_penalties_keep_the_steps_synchronous(tiny_pair):
    """Logprobs are computed on the device at launch and copied with the tokens: the same
    logprobs, steps queued ahead. A penalty (likewise a grammar) needs each step's token on
    the host before the next step: while such a request runs, nothing is queued ahead."""
    prompts = _prompts(3, seed=2)
    requests = [(p, dict(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in prompts]
    requests[1] = (prompts[1], dict(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True, logprobs=True,
                                    top_logprobs=2))
    off, on, queued, stats = _both(tiny_pair.target, requests)
    assert on == off and len(on["1"][2]) == 16 and all(len(ids) == len(lps) == 2 for _, ids, lps in on["1"][2])
    assert queued > 10
    requests[1] = (prompts[1], dict(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3))
    off, on, queued, stats = _both(tiny_pair.target, requests)
    assert on == off and queued == 0


class _RecordingDraft(NoDraft):
    """A draft link that is present, drafts nothing, and records the outcomes it is sent."""

    present = alive = True

    def __init__(self) -> None:
        self.sent: list = []

    def send_outcomes(self, seqs, specs, num_accepted, token_ids, speculated, choose_work_ahead):
        self.sent.append(([s.seq_id for s in seqs], [t[j] for t, j in zip(token_ids, num_accepted)], speculated))
        return True


def test_plain_steps_of_an_sd_engine_send_the_draft_the_same_outcomes_in_order(tiny_pair):
    """Between speculating steps (which never run ahead), the plain steps the policy chooses
    are queued ahead; the draft is sent the same outcomes in the same order either way."""
    prompts = _prompts(4, seed=3)
    for max_tokens in range(14, 19):  # the batch ends at every phase of the plan pattern
        requests = [(p, dict(max_tokens=max_tokens + (i if max_tokens == 18 else 0), temperature=0.0,
                             ignore_eos=True)) for i, p in enumerate(prompts)]
        got = {}
        for overlap in (False, True):
            draft = _RecordingDraft()
            worker, clients = _worker(tiny_pair.target, overlap, mode="sd", draft=draft)
            pattern = iter(([False] * 4 + [True]) * 100)
            worker.policy.use_speculation = lambda batch: next(pattern)
            recorded = []
            worker.policy.record = lambda batch, speculated, num_tokens, seconds: recorded.append(batch)
            out, queued = _serve(worker, clients, requests)
            got[overlap] = (out, draft.sent, worker.timing["num_steps"], recorded)
        assert got[True] == got[False], max_tokens
        assert any(not spec for *_, spec in got[True][1]) and any(spec for *_, spec in got[True][1])


@pytest.mark.parametrize("overlap", [False, True])
def test_the_stats_count_every_step_and_time_the_landing(tiny_pair, overlap):
    worker, clients = _worker(tiny_pair.target, overlap)
    _serve(worker, clients, [(p, dict(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in _prompts(2, 4)])
    stats = worker.engine_stats()
    assert stats.num_steps >= 9 and stats.host_parts["land"] > 0
    assert (stats.num_steps_ahead >= 8) == overlap and stats.num_steps_ahead < stats.num_steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_with_cuda_graphs_the_tokens_are_the_same(tmp_path):
    """The sampled tokens stay on the device and feed the next graph replay; head_dim 128
    (flashinfer's prefill is built for it)."""
    target = save_tiny_model(tmp_path / "tiny", "llama", hidden_size=256, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=512, num_hidden_layers=2)
    prompts = _prompts(7, seed=5, lo=10, hi=40)
    requests = [(p, dict(max_tokens=24 + i, temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]
    off, on, queued, stats = _both(target, requests, device="cuda:0", aborts=("2",), late=3)
    assert on == off
    assert queued > 20


def test_bench_overlap_script_runs_both_schedules(tmp_path):
    """scripts/bench_overlap.py (docs/benchmarks.md's in-process step times): one line per
    schedule and batch size; only `on` queues steps ahead."""
    import subprocess
    import sys
    from pathlib import Path

    target = save_tiny_model(tmp_path / "tiny", "llama", hidden_size=64, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=128, num_hidden_layers=2)
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_overlap.py"
    out = subprocess.run([sys.executable, str(script), "--model", target, "--device", "cpu", "--batches", "2",
                          "--prompt-len", "8", "--max-tokens", "90", "--repeats", "1", "--vocab", "200"],
                         capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()
    lines = [ln for ln in out if ln.startswith("overlap")]
    assert [ln.split()[1] for ln in lines] == ["off", "on"], out
    queued = [int(ln.split("queued ahead ")[1].split(";")[0]) for ln in lines]
    assert queued[0] == 0 and queued[1] >= 80, lines


class _FlagsDraft(_RecordingDraft):
    """As _RecordingDraft, also recording the plan each request names."""

    def send_outcomes(self, seqs, specs, num_accepted, token_ids, speculated, choose_work_ahead):
        super().send_outcomes(seqs, specs, num_accepted, token_ids, speculated, choose_work_ahead)
        self.sent[-1] += (choose_work_ahead(len(seqs)),)
        return True


def test_a_plain_step_before_a_speculating_one_sends_that_ones_request(tiny_pair):
    """Overlap on: the plain step queued ahead lands once the next step's plan is chosen;
    before an SSD or SD round its outcomes go with that round's request, so the draft
    answers and works ahead one step earlier (target_proc/ahead.py). Before a halves or
    plain step, and with every step synchronous, each request names its own step's plan."""
    from target_proc.round_policy import HALVES, PLAIN, SD, RoundPlan

    ssd = RoundPlan("ssd", 3, "none")
    plans = [PLAIN] * 3 + [ssd] * 2 + [PLAIN] * 2 + [SD] + [PLAIN] * 2 + [HALVES] + [PLAIN] * 2
    requests = [(p, dict(max_tokens=len(plans) + 1, temperature=0.0, ignore_eos=True)) for p in _prompts(2, seed=6)]
    got = {}
    for overlap in (False, True):
        draft = _FlagsDraft()
        worker, clients = _worker(tiny_pair.target, overlap, mode="ssd", draft=draft)
        pattern, recorded = itertools.chain(plans, itertools.repeat(PLAIN)), []
        worker.rounds.choose = lambda batch, context=0, steady=True, drain=None: next(pattern)
        worker.rounds.record_step = lambda plan, *a, sent=None, **kw: recorded.append((plan, sent))
        out, _ = _serve(worker, clients, requests)
        assert [plan for plan, _ in recorded][:len(plans)] == plans
        assert [s[-1] for s in draft.sent] == [s for _, s in recorded]
        got[overlap] = out, [s for _, s in recorded][:len(plans)]
    assert got[True][0] == got[False][0]
    assert got[False][1] == plans
    led = list(plans)
    led[2], led[6] = ssd, SD  # the plain steps right before the SSD and SD rounds
    assert got[True][1] == led


@pytest.mark.parametrize("overlap", [False, True])
def test_the_round_policy_times_each_step_from_the_landing_before_it(tiny_pair, overlap):
    """The host's work between two landings (here 20 ms of streaming) is part of one step's
    time as the round policy sees it: a plain step queued behind another is timed from that
    one's landing, and any other step adds the time since the last landing to its busy time."""
    from target_proc.round_policy import PLAIN, SD

    worker, clients = _worker(tiny_pair.target, overlap, mode="ssd", draft=_FlagsDraft())
    pattern, recorded = itertools.cycle([PLAIN, PLAIN, SD]), []
    worker.rounds.choose = lambda batch, context=0, steady=True, drain=None: next(pattern)
    worker.rounds.record_step = lambda plan, specs, nd, na, wait_s, busy_s, *a, **kw: recorded.append(
        (plan, wait_s + busy_s))
    flush = worker.flush_outputs
    worker.flush_outputs = lambda: (time.sleep(0.02), flush())
    _serve(worker, clients, [(p, dict(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in _prompts(2, 7)])
    assert len(recorded) >= 14 and {plan for plan, _ in recorded} == {PLAIN, SD}
    steps = [seconds for _, seconds in recorded[1:]]
    assert sum(steps) >= 0.02 * len(steps)
    if not overlap:
        assert min(steps) >= 0.02, recorded
