"""Plain steps with the overlap schedule off and on, in one process, on one model.

A TargetWorker (AR) over --model serves --batches requests of --prompt-len random tokens
and --max-tokens new ones (T = 0.7, ignore_eos), once with `--overlap-schedule off` and
once `on`, --repeats times each, all on one loaded runner. Per run it prints the median
and mean wall time of `TargetWorker.step` over the middle of the run (the first and last
40 steps left out), the steps queued ahead, and the worker's host parts per step. In
steps 60 to 69 torch's sync debug mode is on, and every synchronizing call it reports is
printed with its call site (the landing's event wait is not one it reports; a `.cpu()`,
`.item()` or pageable copy is).

    python scripts/bench_overlap.py --model random:target-8b --batches 1,4,32 --prompt-len 512 --max-tokens 200
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from collections import deque
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.messages import ErrorReply, GenerateRequest, SamplingParams  # noqa: E402
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from target_proc.model import target_runner  # noqa: E402
from target_proc.worker import TargetWorker  # noqa: E402


class _Channel:
    """The client channel as TargetWorker uses it: requests in, replies dropped (errors raise)."""

    def __init__(self) -> None:
        self.inbox: deque = deque()

    def recv(self, timeout_s: float):
        return self.inbox.popleft() if self.inbox else None

    def send_to(self, ident, msg) -> bool:
        if isinstance(msg, ErrorReply):
            raise RuntimeError(msg.message)
        return True

    def send_error_to(self, ident, code, message, request_id="") -> None:
        raise RuntimeError(message)


def run(runner, cfg: RuntimeConfig, batch: int, prompt_len: int, max_tokens: int, vocab: int) -> None:
    channel = _Channel()
    worker = TargetWorker(cfg, runner, channel, None)
    rng = np.random.default_rng(0)
    for i in range(batch):
        channel.inbox.append((b"c", GenerateRequest(
            request_id=str(i), prompt_token_ids=rng.integers(100, vocab, prompt_len),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True))))
    cuda = cfg.target.device.startswith("cuda")
    syncs: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "prototype" in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename][-5:]
        syncs[" <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames))] += 1

    times: list[float] = []
    shown, warnings.showwarning = warnings.showwarning, show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            while worker.running or worker._ahead or worker.waiting or channel.inbox:
                worker.poll_clients(block=False)
                worker.admit()
                if cuda and len(times) in (60, 70):
                    torch.cuda.set_sync_debug_mode("warn" if len(times) == 60 else 0)
                t = time.perf_counter()
                worker.step()
                times.append(time.perf_counter() - t)
                worker.flush_outputs()
    finally:
        warnings.showwarning = shown
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    mid = sorted(times[40:-40] or times)
    stats = worker.engine_stats()
    parts = ", ".join(f"{k} {1e3 * v / max(stats.num_steps, 1):.3f}" for k, v in stats.host_parts.items())
    print(f"overlap {cfg.sched.overlap_schedule:3} batch {batch:3}: {len(times)} steps, median "
          f"{1e3 * mid[len(mid) // 2]:.3f} ms, mean {1e3 * sum(mid) / len(mid):.3f} ms, queued ahead "
          f"{stats.num_steps_ahead}; host ms per step: {parts}")
    for site, n in syncs.most_common(8):
        print(f"    sync x{n} in steps 60-69: {site}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:target-8b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="1,4,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs per batch size")
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below this")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    runner = None
    for batch in batches:
        for overlap in ("off", "on") * args.repeats:
            cfg = RuntimeConfig(target=ModelConfig(path=args.model, device=args.device, gpu_memory_utilization=0.5),
                                spec=SpeculativeConfig(mode="ar"),
                                sched=SchedulerConfig(max_batch_size=max(batches + [4]), overlap_schedule=overlap,
                                                      max_model_len=args.prompt_len + args.max_tokens + 16))
            runner = runner or target_runner(cfg)
            run(runner, cfg, batch, args.prompt_len, args.max_tokens, args.vocab)


if __name__ == "__main__":
    main()
