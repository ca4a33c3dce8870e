"""SD rounds in one process: the chain drafter alone against the SSD engine answering
every round from its backup (no work-ahead), draft-1b shape (random bf16), K=4, the
synthetic oracle, batch 1 and 4, 512-token prompts, on cuda:0.

    python scripts/ab_sd_rounds.py

Both answer with the same chain; this times them without processes or sockets.
"""

from __future__ import annotations

import time

import torch

from draft_proc.drafter import ModelDrafter
from draft_proc.factory import make_oracle_transform
from draft_proc.ssd import SSDEngine, scratch_rows_needed, tree_local_rows, tree_shapes
from draft_proc.state import DraftSeq
from spec_runtime.config import ModelConfig, SpeculativeConfig
from spec_runtime.model.runner import ModelRunner

K = 4
SLOTS = 16


def time_rounds(drafter: ModelDrafter, ssd: SSDEngine | None, batch: int, rounds: int = 50) -> float:
    """ms per round; every round accepts the whole speculation."""
    seqs = [DraftSeq(i, i, list(range(10, 522)), seed=i) for i in range(batch)]

    def one_round():
        for s in seqs:
            j = len(s.draft_token_ids) if s.awaiting_outcome else 0
            if ssd is not None:
                ssd.note_outcome(s, j, 7)
            s.apply_outcome(j, 7, s.num_tokens + j + 1, s.round + 1)
        if ssd is not None:
            ssd.propose(seqs, K, count_misses=False)
            ssd.skip_work_ahead(seqs)
        else:
            drafter.propose(seqs, K)

    for _ in range(5):
        one_round()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        one_round()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / rounds


def main() -> None:
    for mode in ("sd", "ssd", "sd"):
        spec = SpeculativeConfig(mode=mode, k=K, fan_out=(3,) * (K + 1), synthetic_acceptance=0.8,
                                 synthetic_ranks=(0.5, 0.2, 0.1))
        kw = dict(max_batch_size=SLOTS, graph_q_lens=(1, 2, K + 1))
        if mode == "ssd":  # the graphs and scratch rows the SSD draft process has
            kw = dict(max_batch_size=64, graph_q_lens=(1, 2, K + 1), tree_shapes=tree_shapes(spec, SLOTS),
                      tree_local_rows=tree_local_rows(spec), num_scratch_rows=scratch_rows_needed(spec, SLOTS))
        runner = ModelRunner(ModelConfig(path="random:draft-1b", device="cuda:0", gpu_memory_utilization=0.3),
                             num_slots=SLOTS, max_model_len=1024, **kw)
        drafter = ModelDrafter(runner, spec, logits_transform=make_oracle_transform(spec))
        ssd = SSDEngine(drafter, drafter, spec) if mode == "ssd" else None
        for batch in (1, 4):
            print(f"{mode} runner, batch {batch}: {time_rounds(drafter, ssd, batch):.2f} ms per SD round", flush=True)
        del runner, drafter, ssd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
