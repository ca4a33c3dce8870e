"""The target's runner: on one device, or split over several (tensor parallelism).

Rank 0 (the target process) and the followers (target_proc.follower) build their
runners through `target_runner` with the same config, so they load, size and capture
in the same order and their collectives pair up.
"""

from __future__ import annotations

import msgspec

from protocol.codec import encode_config


def target_runner(cfg, tp=None):
    """The target's ModelRunner (tp: this rank's TPGroup, or None on one device).
    --max-model-len and --max-num-seqs unset: sized here (engine/sizing.py); read
    `runner.layout.max_model_len` and `runner.max_num_seqs`."""
    from spec_runtime.config import default_max_num_seqs, step_token_budget
    from spec_runtime.engine.runner import ModelRunner
    from spec_runtime.engine.sizing import model_context_limit, resolve_max_num_seqs

    # The runner pads verify forwards to K+1 tokens per sequence: one graph per batch size fits.
    q_lens = (1, cfg.spec.k + 1) if cfg.spec.mode != "ar" else (1,)
    sched = cfg.sched
    requested = sched.max_batch_size or default_max_num_seqs(cfg.target.device)
    draft_limit = model_context_limit(cfg.draft_path) if cfg.spec.uses_draft_process and cfg.draft_path else 0
    runner = ModelRunner.build(cfg.target, kernels=cfg.kernels, block_size=sched.block_size,
                               num_blocks=sched.num_kv_blocks, max_model_len=sched.max_model_len,
                               max_batch_size=requested, graph_q_lens=q_lens, tp=tp, context_limit=draft_limit)
    budget = step_token_budget(sched, runner.layout.max_model_len)
    step_cap = budget // (cfg.spec.k + 1 if cfg.spec.mode != "ar" else 1) if budget else 0
    runner.max_num_seqs = resolve_max_num_seqs(sched.max_batch_size, requested, runner.layout.num_blocks, step_cap)
    return runner


def resolved_config(cfg, runner):
    """cfg with the context length and sequence count the target's runner settled on."""
    import dataclasses

    sched = dataclasses.replace(cfg.sched, max_batch_size=runner.max_num_seqs,
                                max_model_len=runner.layout.max_model_len)
    return cfg.replace(sched=sched)


def start_tensor_parallel(cfg, rendezvous: tuple[str, int] | None = None):
    """Rank 0 of --tensor-parallel-size N > 1: start ranks 1..N-1, form the group, send
    them the config. None for N = 1. rendezvous (host, port): the ranks were started by
    someone else (the Ray deployment, one actor per rank) and join there."""
    n = cfg.target.tensor_parallel_size
    if n == 1:
        return None
    from spec_runtime.engine.parallel import TPGroup, free_port, start_followers

    if rendezvous is not None:
        host, port = rendezvous
        group = TPGroup(n, 0, cfg.target.device, port, timeout_s=cfg.startup_timeout_s, host=host)
        group.broadcast_bytes(msgspec.msgpack.encode(encode_config(cfg)))
        return group
    port = free_port()
    procs = start_followers(n, port, cfg.target.device)
    group = TPGroup(n, 0, cfg.target.device, port, timeout_s=cfg.startup_timeout_s, followers=procs)
    group.broadcast_bytes(msgspec.msgpack.encode(encode_config(cfg)))
    return group
