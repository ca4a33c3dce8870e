"""Sizing the KV pool on a GPU: what the weights and a warm-up forward leave.

`fit_kv_rows` runs one prefill of `warmup_tokens` tokens over a temporary pool
(this also JIT-builds flashinfer's kernel and compiles the fused ops for T > 1),
reads the allocator's peak, and returns how many KV rows fit in
`gpu_memory_utilization` of the device. `fit_num_slots` (the draft's slots of
max_model_len rows) and `fit_num_blocks` (the target's blocks) divide them up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from spec_runtime.attention.base import AttentionBackend
from spec_runtime.engine.forward_batch import ForwardItem, build_forward_batch
from spec_runtime.engine.kv_cache import KVCache, kv_bytes_per_token

logger = logging.getLogger(__name__)

# Left free for what comes after sizing: CUDA graphs' pool and flashinfer's
# per-graph index buffers and int workspaces (8 MiB each), cuBLAS workspaces.
GRAPH_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class KVFit:
    """What sizing found: the KV rows that fit, and the figures behind them (bytes)."""

    rows: int
    total: int
    used: int
    budget: int
    utilization: float

    def no_room(self, what: str) -> ValueError:
        return ValueError(
            f"no {what} fits: {self.budget / 2**30:.2f} GiB left of {self.utilization:.2f} x "
            f"{self.total / 2**30:.1f} GiB after {self.used / 2**30:.2f} GiB of weights and activations; lower "
            "max_model_len or raise gpu_memory_utilization")


@torch.inference_mode()
def fit_kv_rows(model, backend: AttentionBackend, *, gpu_memory_utilization: float, max_model_len: int,
                warmup_tokens: int, reserve_bytes: int = 0) -> KVFit:
    """KV rows that fit after the weights, a warm-up forward, the fixed graph reserve
    and `reserve_bytes` more (the graphs' logits buffers)."""
    device = model.embed_tokens.weight.device
    arch, dtype = model.arch, model.embed_tokens.weight.dtype
    n = max(1, min(warmup_tokens, max_model_len))
    tp_size = getattr(model, "tp_size", 1)
    tmp_kv = KVCache(arch.num_layers, n + 1, arch.num_kv_heads // tp_size, arch.head_dim, dtype, device)
    model.bind(backend, tmp_kv)
    torch.cuda.synchronize(device)  # sync: start-up sizing, before the peak is read
    torch.cuda.reset_peak_memory_stats(device)
    rng = np.random.default_rng(0)
    item = ForwardItem(token_ids=rng.integers(0, arch.vocab_size, n), start_pos=0,
                       kv_rows=np.arange(n, dtype=np.int64), logits="last")
    batch = build_forward_batch([item], device)
    backend.begin(batch)
    hidden = model(batch.input_ids, batch.positions, batch)
    model.compute_logits(hidden[batch.logits_indices])
    torch.cuda.synchronize(device)  # sync: start-up sizing
    peak = torch.cuda.max_memory_allocated(device)
    model.kv_cache = None  # unbind the temporary pool; the runner binds the real one
    del tmp_kv, hidden, batch
    torch.cuda.empty_cache()

    total = torch.cuda.get_device_properties(device).total_memory
    tmp_bytes = kv_bytes_per_token(arch, dtype, tp_size) * (n + 1)
    used = peak - tmp_bytes  # weights + activations + workspaces
    budget = int(total * gpu_memory_utilization) - used - GRAPH_RESERVE_BYTES - reserve_bytes
    rows = max(0, budget // kv_bytes_per_token(arch, dtype, tp_size))
    logger.info("GPU memory: total %.1f GiB, weights+activations %.2f GiB, KV budget %.2f GiB -> %d KV rows fit",
                total / 2**30, used / 2**30, budget / 2**30, rows)
    return KVFit(int(rows), total, used, budget, gpu_memory_utilization)


def fit_num_slots(model, backend: AttentionBackend, *, gpu_memory_utilization: float, num_slots: int,
                  max_model_len: int, num_scratch_rows: int, warmup_tokens: int, reserve_bytes: int = 0) -> int:
    """Slots of max_model_len rows that fit beside num_scratch_rows and the dummy row, at most num_slots."""
    kv = fit_kv_rows(model, backend, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                     warmup_tokens=warmup_tokens, reserve_bytes=reserve_bytes)
    fit = (kv.rows - num_scratch_rows - 1) // max_model_len
    if fit < 1:
        raise kv.no_room(f"KV slot of {max_model_len} rows")
    if fit < num_slots:
        logger.warning("only %d of %d KV slots fit in gpu_memory_utilization=%.2f",
                       fit, num_slots, gpu_memory_utilization)
    return int(min(num_slots, fit))


def fit_num_blocks(model, backend: AttentionBackend, *, gpu_memory_utilization: float, block_size: int,
                   max_model_len: int, warmup_tokens: int, reserve_bytes: int = 0, num_scratch_rows: int = 0) -> int:
    """KV blocks of block_size rows that fit beside num_scratch_rows and the dummy row."""
    kv = fit_kv_rows(model, backend, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                     warmup_tokens=warmup_tokens, reserve_bytes=reserve_bytes)
    fit = (kv.rows - num_scratch_rows - 1) // block_size
    if fit < 1:
        raise kv.no_room(f"KV block of {block_size} rows")
    return int(fit)
