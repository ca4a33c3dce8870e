"""The chain drafter's propose(), greedy against sampled (T = 0.7): draft-1b, K=4,
512-token contexts, the synthetic oracle, batch 4 and 32; then torch.profiler's top ops
of five sampled and five greedy chains at batch 4 (host time first, then GPU time).

    python scripts/profile_chain.py

One CUDA device. A chain whose host work outlasts its GPU work is as slow as its host:
the profile shows which ops the host spends it on.
"""

from __future__ import annotations

import time

import numpy as np
import torch

K = 4


def main() -> None:
    from draft_proc.drafter import ModelDrafter
    from draft_proc.state import DraftSeq
    from spec_runtime.bench.oracle import draft_oracle
    from spec_runtime.config import ModelConfig, SpeculativeConfig
    from spec_runtime.engine.runner import ModelRunner

    spec = SpeculativeConfig(mode="sd", k=K, synthetic_acceptance=(0.6, 0.5, 0.2, 0.1))
    runner = ModelRunner.build(ModelConfig(path="random:draft-1b", device="cuda:0"), num_slots=32,
                               max_model_len=1024, max_batch_size=32, graph_q_lens=(1, 2, K + 1))
    drafter = ModelDrafter(runner, spec, logits_transform=draft_oracle(spec.synthetic_acceptance))
    rng = np.random.default_rng(0)

    def run(batch: int, temp: float, n: int = 20, prof: bool = False) -> None:
        seqs = [DraftSeq(i, i, rng.integers(10, 1000, size=512).tolist(), temperature=temp, seed=i)
                for i in range(batch)]
        drafter.propose(seqs, K)

        def cycle():
            for s in seqs:
                s.apply_outcome(0, 5, s.num_tokens + 1, s.round + 1)
            drafter.propose(seqs, K)

        for _ in range(3):
            cycle()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            cycle()
        torch.cuda.synchronize()
        print(f"batch {batch} T={temp}: chain propose {1e3 * (time.perf_counter() - t) / n:.2f} ms", flush=True)
        if prof:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    cycle()
            print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)

    for b in (4, 32):
        for t in (0.0, 0.7):
            run(b, t)
    run(4, 0.7, prof=True)
    run(4, 0.0, prof=True)


if __name__ == "__main__":
    main()
