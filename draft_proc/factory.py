"""Build the draft process's speculators from the config."""

from __future__ import annotations

import logging

from draft_proc.ngram import NgramSpeculator

logger = logging.getLogger(__name__)

# The n-gram speculator never indexes by token id; the target validates ids anyway.
NGRAM_VOCAB_BOUND = 2**31 - 1


def make_speculators(cfg):
    """-> (speculator, ssd engine or None, vocab size for validation, info): info has the
    Ready fields (kv_capacity, model_name) and "kv", the draft_proc.kv.DraftKV that
    holds the sequences' KV blocks (None for the n-gram speculator)."""
    spec = cfg.spec
    max_len = cfg.sched.max_model_len  # 0: the draft model's own limit (the target's is never longer)
    num_slots = draft_slots_requested(cfg)
    if cfg.draft_name == "ngram":
        if spec.mode == "ssd":
            raise ValueError("--mode ssd needs a draft model (--draft PATH); the n-gram speculator has no tree to build")
        info = {"model_name": "ngram", "num_slots": num_slots, "max_model_len": max_len, "kv": None}
        return NgramSpeculator(spec.ngram_min, spec.ngram_max, max_len or NGRAM_VOCAB_BOUND), None, NGRAM_VOCAB_BOUND, info

    from draft_proc.drafter import ModelDrafter
    from draft_proc.kv import DraftKV

    runner = _draft_runner(cfg, num_slots, max_len)
    kv = DraftKV(runner.layout, spec.k, num_slots, cfg.sched.enable_prefix_caching)
    transform = None
    if spec.synthetic_acceptance:  # benchmarks only
        from spec_runtime.bench.oracle import draft_oracle

        transform = draft_oracle(spec.synthetic_acceptance)
        transform.warm_up(runner.device, runner.vocab_size)
    drafter = ModelDrafter(runner, spec, logits_transform=transform, kv=kv)
    ssd = None
    if spec.mode == "ssd":
        from draft_proc.ssd import SSDEngine

        backup = {
            "auto": drafter,  # the round policy asks for no backup per request where that pays
            "jit": drafter,
            "ngram": NgramSpeculator(spec.ngram_min, spec.ngram_max, runner.layout.max_model_len),
            "none": None,
        }[spec.backup]
        ssd = SSDEngine(drafter, backup, spec)
        if ssd.forks_on_device:
            from draft_proc.fork_device import warm_up

            warm_up(runner, spec)
    layout = runner.layout
    logger.info("draft: %d KV blocks of %d rows for up to %d sequences of up to %d tokens", layout.num_blocks,
                layout.block_size, num_slots, layout.max_model_len)
    info = {"kv_capacity": layout.num_blocks * layout.block_size, "model_name": runner.model_name,
            "num_slots": num_slots, "max_model_len": layout.max_model_len, "kv": kv}
    return drafter, ssd, runner.vocab_size, info


def draft_slots_requested(cfg) -> int:
    """The sequences the draft holds: --max-draft-seqs, else --max-num-seqs, else the
    device's default."""
    from spec_runtime.config import default_max_num_seqs

    sched = cfg.sched
    return sched.max_draft_seqs or sched.max_batch_size or default_max_num_seqs(cfg.draft.device)


def _draft_runner(cfg, num_slots: int, max_len: int):
    """The draft's ModelRunner: a paged pool, SSD scratch rows and tree graphs in ssd mode."""
    from spec_runtime.engine.runner import ModelRunner
    from spec_runtime.engine.sizing import CPU_ROWS_PER_SEQ, cpu_pool_rows

    spec = cfg.spec
    scratch, shapes, local_rows = 0, (), 0
    if spec.mode == "ssd":
        from draft_proc.tree_budget import scratch_rows_needed, tree_local_rows, tree_shapes

        scratch = scratch_rows_needed(spec, num_slots)
        shapes, local_rows = tree_shapes(spec, num_slots), tree_local_rows(spec)
    # Graph shapes: decode steps (q_len 1, also the per-branch tree steps near the context
    # limit, up to tree_budget branches), the two-token catch-up after an outcome, the
    # K+1-token SSD glue, and the shared-prefix tree steps.
    max_batch = max(num_slots, spec.max_tree_budget) if spec.mode == "ssd" else num_slots
    # Paged KV: blocks for num_slots contexts of max_len tokens (on CUDA, at most what
    # --draft-gpu-memory-utilization leaves on the draft's device, which it may share; with
    # max_len unset, what fits). On the CPU, the target's CPU pool for num_slots sequences.
    bs = cfg.sched.block_size
    if cfg.draft_model.device == "cpu":
        num_blocks = -(-cpu_pool_rows(num_slots, max_len or CPU_ROWS_PER_SEQ) // bs)
    else:
        num_blocks = -(-num_slots * max_len // bs)
    runner = ModelRunner.build(cfg.draft_model, kernels=cfg.kernels, max_model_len=max_len, block_size=bs,
                               num_scratch_rows=scratch, max_batch_size=max_batch, num_blocks=num_blocks,
                               graph_q_lens=(1, 2, spec.k + 1), tree_shapes=shapes, tree_local_rows=local_rows)
    runner.warm_sampling_kernels(spec.draft_top_k)
    return runner
