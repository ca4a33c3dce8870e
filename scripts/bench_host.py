"""Host time of the target's per-step bookkeeping, without a model: the parts of a step
that bench_e2e.py's `host_parts_ms_per_step` names.

  - accept: TargetWorker._accept over B sequences (real Sequence, StopChecker and
    KVScheduler with prefix caching), each accepting a random 0..K drafts plus one token;
  - outcomes: DraftLink.send_outcomes of a plain step and of an SD round over B
    sequences, sent over ipc to a process that drains the socket;
  - policy: RoundPolicy.choose and record_step per step over B sequences, as the SSD
    engine calls them, once the policy has settled on plain steps (fed a simulated draft
    whose SSD and SD rounds yield 2 tokens per sequence in 18 ms against 7.4 ms for a
    plain step): the engine's `policy_ms_per_step` measures the same calls between GPU steps.

    python scripts/bench_host.py --batch 64 --k 4 --out bench/results/host_step_b64_cpu.json

Each part runs --steps steps per repeat; the JSON keeps every repeat's mean (us per step).
Between GPU steps the host's caches are cold: the forward's launch, the result copy and
the wait touch other code and data. --gap-ms sleeps that long before every timed step (as
the host waits for the GPU) and --evict-mb streams that many MB through the caches first
(as the rest of a step does); only the step itself is timed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import time
from types import SimpleNamespace

import zmq

from protocol.messages import SamplingParams, SpecLinkToTarget
from protocol.sparse_q import NO_DRAFT
from protocol.transport import Channel, ipc_address, private_ipc_dir
from spec_runtime.engine.kv_blocks import KVBlocks
from target_proc.draft_link import DraftLink
from target_proc.kv_schedule import KVScheduler
from target_proc.round_model import PLAIN, SD
from target_proc.round_policy import RoundPolicy
from target_proc.sequence import Sequence, StopChecker
from target_proc.worker import TargetWorker

PROMPT = 1024


class Between:
    """What runs before each timed step: a sleep of gap_ms, then evict_mb MB streamed
    through the caches. timed(fn) runs it, then fn, and returns fn's seconds."""

    def __init__(self, gap_ms: float = 0.0, evict_mb: int = 0):
        import numpy as np

        self.gap_s = gap_ms / 1e3
        self.buf = np.ones(evict_mb << 20, dtype=np.uint8) if evict_mb else None

    def timed(self, fn) -> float:
        if self.gap_s:
            time.sleep(self.gap_s)
        if self.buf is not None:
            self.buf.sum()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _sequences(batch: int, k: int, steps: int, rng: random.Random) -> tuple[SimpleNamespace, list[Sequence]]:
    """B sequences of PROMPT tokens with KV tables for `steps` verify steps, and a stand-in
    for the worker that _accept reads."""
    kv = KVBlocks(batch * (PROMPT + (k + 1) * steps) // 16 + 4 * batch, 16, True)
    sched = KVScheduler(kv, k, PROMPT + (k + 1) * steps + 16, batch, None)
    seqs = []
    for i in range(batch):
        s = Sequence(seq_id=i, request_id=str(i), client=b"c", prompt_token_ids=[rng.randrange(1000) for _ in range(PROMPT)],
                     sampling=SamplingParams(max_tokens=1 << 30, ignore_eos=True), seed=i)
        s.stats.accepted_per_position, s.stats.drafted_per_position = [0] * k, [0] * k
        kv.admit(i, s.token_ids, PROMPT + (k + 1) * steps + 8, PROMPT)
        seqs.append(s)
    worker = SimpleNamespace(cfg=SimpleNamespace(spec=SimpleNamespace(mode="sd")), _last_flags=(True,) * 3, k=k,
                             stop_checker=StopChecker([0], 1 << 30), sched=sched, finish=lambda s: None,
                             _grammar_commit=lambda seq, token_ids: False)  # no grammar: False at once
    return worker, seqs


def time_accept(batch: int, k: int, steps: int, seed: int, between: Between) -> float:
    rng = random.Random(seed)
    worker, seqs = _sequences(batch, k, steps, rng)
    accepted = [[rng.randrange(k + 1) for _ in range(batch)] for _ in range(steps)]
    tokens = [[rng.randrange(1000) for _ in range(k + 1)] for _ in range(batch)]
    total = sum(between.timed(lambda j=j: TargetWorker._accept(worker, seqs, {}, [k] * batch, j, tokens, None, True))
                for j in accepted)
    return 1e6 * total / steps


def time_policy(batch: int, k: int, steps: int, between: Between, warmup: int = 400) -> float:
    """us per step of choose + record_step once plain steps have won (see the module doc)."""
    policy = RoundPolicy(lambda b: [15, 7, 3], k=k, short_jit=k // 4)
    hit = SimpleNamespace(cache_hit=True, hit_rank=0)

    def step() -> None:
        plan = policy.choose(batch, PROMPT, True)
        specs = {i: hit for i in range(batch)} if plan.speculate else {}
        drafted = [k if plan.speculate else 0] * batch
        policy.record_step(plan, specs, drafted, [1 if plan.speculate else 0] * batch,
                           0.0096 if plan.speculate else 0.0, 0.0084 if plan.speculate else 0.0074,
                           0.008 if plan.work_ahead else 0.0, context=PROMPT, batch=batch)

    for _ in range(warmup):
        step()
    return 1e6 * sum(between.timed(step) for _ in range(steps)) / steps


def _drain(address: str) -> None:
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(address)
    while sock.recv_multipart():
        pass


def time_outcomes(batch: int, k: int, steps: int, between: Between) -> dict[str, float]:
    ipc_dir = private_ipc_dir()
    address = ipc_address(ipc_dir, "spec")
    peer = mp.get_context("spawn").Process(target=_drain, args=(address,), daemon=True)
    peer.start()
    link = DraftLink(Channel(zmq.PAIR, SpecLinkToTarget), address, timeout_s=5.0, k=k, vocab_size=1000)
    try:
        link.wait_connected(10.0)
        seqs = [Sequence(seq_id=i, request_id=str(i), client=b"c", prompt_token_ids=list(range(PROMPT)),
                         sampling=SamplingParams(max_tokens=1 << 30), seed=i) for i in range(batch)]
        link.synced.update(range(batch))
        tokens, out = [[5] * (k + 1)] * batch, {}
        for name, plan, specs in (("plain", PLAIN, {}), ("sd", SD, dict.fromkeys(range(batch), NO_DRAFT))):
            def send(specs=specs, plan=plan):
                link.send_outcomes(seqs, specs, [0] * batch, tokens, plan.speculate, lambda n: plan)

            out[name] = 1e6 * sum(between.timed(send) for _ in range(steps)) / steps
        return out
    finally:
        link.channel.close()
        peer.kill()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="sleep before each timed step (a GPU wait)")
    ap.add_argument("--evict-mb", type=int, default=0, help="MB streamed through the caches before each timed step")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    between = Between(args.gap_ms, args.evict_mb)
    runs = []
    for r in range(args.repeats):
        runs.append({"accept_us": time_accept(args.batch, args.k, args.steps, r, between),
                     "policy_us": time_policy(args.batch, args.k, args.steps, between),
                     **{f"outcomes_{n}_us": v for n, v in time_outcomes(args.batch, args.k, args.steps, between).items()}})
        print(f"repeat {r}: " + ", ".join(f"{n} {v:.1f}" for n, v in runs[-1].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
