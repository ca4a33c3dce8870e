"""Build the draft process's speculators from the config."""

from __future__ import annotations

import numpy as np
import torch

from draft_proc.ngram import NgramSpeculator
from spec_runtime.oracle import draft_oracle_logits, draft_oracle_slots, scatter_slots

# The n-gram speculator never indexes by token id; the target validates ids anyway.
NGRAM_VOCAB_BOUND = 2**31 - 1


class OracleTransform:
    """The draft half of the synthetic acceptance oracle (benchmarks only).

    transform(logits [N, V], seqs, positions [N]) replaces the logits; `chain` computes
    the oracle's slots for every step of a chain at once (they depend on (seed,
    position) only), so each step costs one scatter on the device and no host work.
    """

    def __init__(self, alpha: float, ranks: tuple[float, ...]) -> None:
        self.alpha = alpha
        self.ranks = tuple(ranks)

    def __call__(self, logits, seqs, positions: np.ndarray):
        # Host tensors: the oracle hashes on the CPU and scatters once on the device.
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64)
        pos = torch.from_numpy(np.asarray(positions, dtype=np.int64))
        return draft_oracle_logits(logits, seeds, pos, self.alpha, self.ranks)

    def chain(self, seqs, positions: np.ndarray, num_steps: int, vocab: int, device):
        """Per-step transforms for steps 0..num_steps-1 of a chain whose step i predicts
        positions + i ([R]): a list of functions logits [R, V] -> logits."""
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64)[None, :].expand(num_steps, -1)
        pos = torch.from_numpy(np.asarray(positions, dtype=np.int64))[None, :] + torch.arange(num_steps)[:, None]
        tokens, slot_logits = draft_oracle_slots(seeds, pos, vocab, self.alpha, self.ranks)  # [S_steps, R, slots]
        if device.type == "cuda":
            tokens = tokens.pin_memory().to(device, non_blocking=True)
            slot_logits = slot_logits.pin_memory().to(device, non_blocking=True)
        return [lambda logits, t=tokens[i]: scatter_slots(logits, t, slot_logits) for i in range(num_steps)]


def make_oracle_transform(spec_cfg) -> OracleTransform | None:
    """The draft half of the synthetic acceptance oracle (benchmarks only), or None."""
    if spec_cfg.synthetic_acceptance is None:
        return None
    return OracleTransform(spec_cfg.synthetic_acceptance, tuple(spec_cfg.synthetic_ranks))


def make_speculators(cfg):
    """-> (speculator, ssd engine or None, vocab size for validation, info for Ready)."""
    spec = cfg.spec
    max_len = cfg.sched.max_model_len
    if cfg.draft_name == "ngram":
        if spec.mode == "ssd":
            raise ValueError("--mode ssd needs a draft model (--draft PATH); the n-gram speculator has no tree to build")
        return NgramSpeculator(spec.ngram_min, spec.ngram_max, max_len), None, NGRAM_VOCAB_BOUND, {"model_name": "ngram"}

    from draft_proc.drafter import ModelDrafter
    from spec_runtime.engine.runner import ModelRunner

    num_slots = cfg.sched.max_draft_seqs or cfg.sched.max_batch_size
    scratch, shapes, local_rows = 0, (), 0
    if spec.mode == "ssd":
        from draft_proc.ssd import scratch_rows_needed, tree_local_rows, tree_shapes

        scratch = scratch_rows_needed(spec, num_slots)
        shapes, local_rows = tree_shapes(spec, num_slots), tree_local_rows(spec)
    # Graph shapes: decode steps (q_len 1, also the per-branch tree steps near the context
    # limit, up to tree_budget branches), the two-token catch-up after an outcome, the
    # K+1-token SSD glue, and the shared-prefix tree steps.
    max_batch = max(num_slots, spec.tree_budget) if spec.mode == "ssd" else num_slots
    runner = ModelRunner.build(cfg.draft, kernels=cfg.kernels, num_slots=num_slots, max_model_len=max_len,
                               num_scratch_rows=scratch, max_batch_size=max_batch, graph_q_lens=(1, 2, spec.k + 1),
                               tree_shapes=shapes, tree_local_rows=local_rows)
    drafter = ModelDrafter(runner, spec, logits_transform=make_oracle_transform(spec))
    ssd = None
    if spec.mode == "ssd":
        from draft_proc.ssd import SSDEngine

        backup = {
            "jit": drafter,
            "ngram": NgramSpeculator(spec.ngram_min, spec.ngram_max, max_len),
            "none": None,
        }[spec.backup]
        ssd = SSDEngine(drafter, backup, spec)
    info = {"kv_capacity": runner.layout.num_rows, "model_name": runner.model_name}
    return drafter, ssd, runner.vocab_size, info
