"""SD rounds in one process, built as the draft process builds them
(draft_proc.factory.make_speculators): the chain drafter of `--mode sd` against the SSD
engine of `--mode ssd` answering every round from its backup (no work-ahead). draft-1b
shape (random bf16), K=4, fan-out 3, the synthetic oracle, 512-token prompts, on cuda:0.

    python scripts/ab_sd_rounds.py [--batches 1,4] [--max-batch-size 4] [--profile]

Prints, per engine and batch, the first round's time and the mean of 50 rounds after 5
untimed ones; --profile adds the CUDA kernels of 10 rounds at the first batch size.
"""

from __future__ import annotations

import argparse
import time

import torch

from draft_proc.factory import make_speculators
from draft_proc.state import DraftSeq
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

K = 4
PROMPT = 512


def one_round(spec, ssd, seqs, kv) -> None:
    """Every round accepts the whole speculation, as the target would report it."""
    for s in seqs:
        j = len(s.draft_token_ids) if s.awaiting_outcome else 0
        if ssd is not None:
            ssd.note_outcome(s, j, 7)
        s.apply_outcome(j, 7, s.num_tokens + j + 1, s.round + 1)
        if not kv.grow(s):
            raise SystemExit("the draft's KV pool is full: fewer rounds or a smaller batch")
    if ssd is not None:
        ssd.propose(seqs, K, count_misses=False)
        ssd.skip_work_ahead(seqs)
    else:
        spec.propose(seqs, K)


def new_seqs(kv, batch: int, first_id: int) -> list[DraftSeq]:
    """`batch` sequences of a PROMPT-token prompt, each holding KV blocks (distinct
    prompts per call, so no prefix is cached)."""
    seqs = []
    for i in range(first_id, first_id + batch):
        tokens = [10 + i] + list(range(10, 10 + PROMPT - 1))
        slot, cached = kv.admit(i, tokens)
        seqs.append(DraftSeq(i, slot, tokens, seed=i, num_cached=cached))
    return seqs


def time_rounds(spec, ssd, kv, batch: int, rounds: int = 50) -> tuple[float, float]:
    """(ms of the first round, ms per round after 5 untimed ones)."""
    seqs = new_seqs(kv, batch, 1000 * batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    one_round(spec, ssd, seqs, kv)
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - t0)
    for _ in range(4):
        one_round(spec, ssd, seqs, kv)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        one_round(spec, ssd, seqs, kv)
    torch.cuda.synchronize()
    return first_ms, 1e3 * (time.perf_counter() - t0) / rounds


def profile_rounds(spec, ssd, kv, batch: int) -> str:
    seqs = new_seqs(kv, batch, 10**6)
    for _ in range(5):
        one_round(spec, ssd, seqs, kv)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            one_round(spec, ssd, seqs, kv)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--max-batch-size", type=int, default=4, help="as bench_e2e: its largest batch")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for mode in ("sd", "ssd", "sd"):
        cfg = RuntimeConfig(
            target=ModelConfig(path="random:draft-1b", device="cuda:0"),
            draft=ModelConfig(path="random:draft-1b", device="cuda:0", gpu_memory_utilization=0.3),
            spec=SpeculativeConfig(mode=mode, k=K, fan_out=(3,) * (K + 1), synthetic_acceptance=(0.8, 0.5, 0.2, 0.1)),
            sched=SchedulerConfig(max_batch_size=args.max_batch_size, max_model_len=PROMPT + 320),
        )
        spec, ssd, _, info = make_speculators(cfg)
        kv = info["kv"]
        for batch in batches:
            first, steady = time_rounds(spec, ssd, kv, batch)
            print(f"{mode} engine, batch {batch}: first round {first:.2f} ms, then {steady:.2f} ms per SD round",
                  flush=True)
        if args.profile:
            print(f"{mode} engine, batch {batches[0]}, 10 rounds:\n{profile_rounds(spec, ssd, kv, batches[0])}", flush=True)
        del spec, ssd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
