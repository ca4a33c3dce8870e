"""CUDA attention over the token-granular KV pool: Triton kernels for every short,
uniform-q_len forward, flashinfer 0.5.2 (page_size 1) for the rest.

The pool's per-layer [num_rows, H, D] tensors are viewed as NHD pages of one token,
[num_rows, 1, H, D], so a ForwardBatch's kv_indices *is* the page table and every
page is full (kv_last_page_len = 1).

- Uniform q_len <= MAX_TRITON_Q_LEN (decode, verify of K+1, SSD glue and tree steps,
  and so every CUDA graph): kernels.paged.paged_attention, which reads kv_indptr and
  kv_indices on the device and needs no host planning. That makes a step's host work
  a few copies and one graph launch, and lets the host queue steps ahead of the GPU.
- Anything else (prefill, ragged batches): flashinfer's BatchPrefillWithPagedKVCacheWrapper
  with causal=True (or its decode wrapper for q_len 1). flashinfer aligns the causal
  mask bottom-right when q_len < kv_len (query i of a request sees kv
  [0, kv_len - q_len + i]), which is forward_batch.py's rule.

`graph_attention="flashinfer"` (KernelConfig.attention_backend) sends the short
forwards and the graphs to flashinfer too (its use_cuda_graph wrappers, planned on the
host before every replay); docs/kernels.md says how the two compare.

flashinfer's `plan()` is host work: it reads the host indptr arrays, writes the plan
into one pinned host buffer per wrapper and queues an async copy of it into the
wrapper's int workspace. Planning a wrapper again overwrites that host buffer, so
before it does, the backend waits for an event recorded after the previous plan's
copy (`_plan`). Forwards queued back to back (prefill pieces with no decode between
them) otherwise hand a forward still in the queue the plan of the next one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from spec_runtime.attention.base import AttentionBackend, GraphAttention
from spec_runtime.kernels.paged import MAX_TILE_M, num_splits_for, paged_attention
from spec_runtime.kernels.paged import warm_up as paged_warm_up

if TYPE_CHECKING:  # types only: the engine's data structures, which the engine hands in
    from spec_runtime.engine.forward_batch import ForwardBatch
    from spec_runtime.engine.kv_cache import KVCache

logger = logging.getLogger(__name__)

# Split-kv scratch shared by every wrapper of a backend (safe: one stream, one forward
# at a time). flashinfer recommends 128 MiB; a verify of 16 x 9 tokens with 64 query
# heads (target-32b) needs 138 MB, so 256 MiB.
WORKSPACE_BYTES = 256 * 1024 * 1024
# fa2 explicitly: "auto" picks fa3 on Hopper, which for page_size 1 adds a
# sparse-index conversion kernel and a second, slower JIT build.
FI_BACKEND = "fa2"
# Longest uniform q_len the Triton kernel serves (verify of K+1 <= 16 tokens).
MAX_TRITON_Q_LEN = 16


def _flashinfer():
    try:
        import flashinfer  # noqa: PLC0415 (optional GPU dependency)
    except ImportError as e:  # pragma: no cover - only on a CUDA host without the wheel
        raise ImportError(
            "the CUDA backend needs flashinfer-python==0.5.2 (pip install \"spec-runtime[gpu]\")"
        ) from e
    return flashinfer


def _host_i32(a: np.ndarray) -> torch.Tensor:
    # Pageable host memory on purpose: flashinfer's plan copies these with
    # non_blocking=True, and a pageable source is staged at once, so reusing the
    # numpy array next step cannot race with a copy still in the queue.
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


@dataclass
class CudaGraphAttention(GraphAttention):
    """A captured shape's attention on this backend.

    Triton (wrapper None): the captured kernels read the static batch's kv_indptr and
    kv_indices, which the graph runner refills; `num_splits` is fixed at capture.
    flashinfer: a wrapper in CUDA-graph mode whose preallocated index buffers the
    captured kernels read; `begin_graph` plans it (and flashinfer's int workspace)
    before each replay.
    """

    wrapper: object | None = None
    num_splits: int = 1
    last_page_len_cpu: torch.Tensor | None = None  # [batch_size] int32 ones (page_size 1)
    qo_indptr_cpu: torch.Tensor | None = None  # [batch_size + 1] int32, fixed: q_len per request


@dataclass
class _Active:
    """The plan of the batch being run: Triton (wrapper None, with its kv splits) or a
    planned flashinfer wrapper."""

    batch: ForwardBatch
    wrapper: object | None = None
    num_splits: int = 1


class CudaAttentionBackend(AttentionBackend):
    """Triton paged attention and flashinfer; page_size 1 over KVCache rows (NHD).

    graph_attention: who serves short uniform forwards and CUDA graphs, "triton" (no
    host plan) or "flashinfer".
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, graph_attention: str = "triton") -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"flashinfer attention needs bfloat16 or float16, got {dtype}")
        self.fi = _flashinfer()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        if graph_attention not in ("triton", "flashinfer"):
            raise ValueError(f"graph_attention must be triton or flashinfer, got {graph_attention!r}")
        self.graph_attention = graph_attention
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        self.scale = head_dim**-0.5
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend=FI_BACKEND)
        self._prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=FI_BACKEND)
        self._active: _Active | None = None
        self._plan_copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its last plan's copy

    # ---- planning -------------------------------------------------------------

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """wrapper.plan(*args, **kwargs), once the copy of its previous plan has run: the
        host buffer it is copied from is the one this plan writes (see the module doc).
        The wait ends when the GPU reaches that copy, not when the forward after it ends."""
        done = self._plan_copied.get(id(wrapper))
        if done is None:
            done = self._plan_copied[id(wrapper)] = torch.cuda.Event()
        else:
            done.synchronize()  # sync: at most until the previous plan's copy has run
        wrapper.plan(*args, **kwargs)
        done.record(torch.cuda.current_stream(self.device))

    def _plan_decode(self, wrapper, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     last_page_len: torch.Tensor) -> None:
        self._plan(
            wrapper, kv_indptr, kv_indices, last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, 1,
            pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype,
            non_blocking=True, disable_split_kv=False,
        )

    def _plan_prefill(self, wrapper, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        self._plan(
            wrapper, qo_indptr, kv_indptr, kv_indices, last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, 1,
            causal=True, pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype,
            non_blocking=True, disable_split_kv=False,
        )

    def fits_triton(self, num_tokens: int, num_requests: int, q_len: int, tree: bool = False) -> bool:
        """Whether the Triton kernel serves a batch of this shape (uniform, short q_len;
        a tree step's q_len is its branches per request, bounded by the tile only)."""
        return (self.graph_attention == "triton" and num_tokens == num_requests * q_len
                and (tree or q_len <= MAX_TRITON_Q_LEN) and q_len * (self.num_heads // self.num_kv_heads) <= MAX_TILE_M)

    def supports_tree(self, q_len: int) -> bool:
        """Tree steps run on the Triton kernel only (flashinfer 0.5.2 has no per-token window)."""
        return self.graph_attention == "triton" and q_len * (self.num_heads // self.num_kv_heads) <= MAX_TILE_M

    def warm_up(self, trees: bool) -> None:
        """Compile the Triton kernel's variants that this backend's forwards can meet (every
        tile of up to MAX_TRITON_Q_LEN queries, the tree tiles where `trees`, the merge at
        every split count) now, not in the step that first meets one (kernels/paged.py)."""
        if self.graph_attention == "triton":
            group = self.num_heads // self.num_kv_heads
            paged_warm_up(self.device, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype,
                          max_q_len=MAX_TRITON_Q_LEN, tree_q_len=MAX_TILE_M // group if trees else 0)

    def begin(self, batch: ForwardBatch) -> None:
        """Plan `batch` (host work; no device sync). Triton batches need no plan."""
        r = batch.num_requests
        tree = batch.tree is not None
        if tree and not self.fits_triton(int(batch.input_ids.shape[0]), r, batch.max_q_len, tree=True):
            raise ValueError(f"a tree step of {batch.max_q_len} branches per request does not fit the Triton kernel")
        if self.fits_triton(int(batch.input_ids.shape[0]), r, batch.max_q_len, tree=tree):
            max_kv = int(np.diff(batch.kv_indptr_cpu).max())
            tile_rows = batch.max_q_len * (self.num_heads // self.num_kv_heads)
            splits = num_splits_for(r, self.num_kv_heads, self.num_sms, max_kv, tile_rows=tile_rows,
                                    head_dim=self.head_dim)
            self._active = _Active(batch, num_splits=splits)
            return
        kv_indptr = _host_i32(batch.kv_indptr_cpu)  # [R+1]
        last_page_len = torch.ones(r, dtype=torch.int32)  # [R]
        if batch.is_decode:
            self._plan_decode(self._decode, kv_indptr, batch.kv_indices, last_page_len)
            self._active = _Active(batch, wrapper=self._decode)
        else:
            qo_indptr = _host_i32(batch.qo_indptr_cpu)  # [R+1]
            self._plan_prefill(self._prefill, qo_indptr, kv_indptr, batch.kv_indices, last_page_len)
            self._active = _Active(batch, wrapper=self._prefill)

    def make_graph_attention(self, batch_size: int, q_len: int, max_kv_rows: int,
                             tree: bool = False) -> CudaGraphAttention:
        """The attention of a graph for `batch_size` requests of `q_len` tokens each
        (tree: a tree step's, which only the Triton kernel serves)."""
        if tree and not self.fits_triton(batch_size * q_len, batch_size, q_len, tree=True):
            raise ValueError(f"a tree step of {q_len} branches per request does not fit the Triton kernel")
        if self.fits_triton(batch_size * q_len, batch_size, q_len, tree=tree):
            tile_rows = q_len * (self.num_heads // self.num_kv_heads)
            splits = num_splits_for(batch_size, self.num_kv_heads, self.num_sms, tile_rows=tile_rows,
                                    head_dim=self.head_dim)
            return CudaGraphAttention(batch_size, q_len, max_kv_rows, wrapper=None, num_splits=splits)
        dev = self.device
        indptr_buf = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        indices_buf = torch.zeros(max_kv_rows, dtype=torch.int32, device=dev)
        last_buf = torch.ones(batch_size, dtype=torch.int32, device=dev)
        if q_len == 1:
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
                paged_kv_last_page_len_buffer=last_buf, backend=FI_BACKEND)
        else:
            qo_buf = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
            wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_buf,
                paged_kv_indptr_buf=indptr_buf, paged_kv_indices_buf=indices_buf,
                paged_kv_last_page_len_buf=last_buf, backend=FI_BACKEND)
        return CudaGraphAttention(
            batch_size=batch_size, q_len=q_len, max_kv_rows=max_kv_rows, host_plan=True, wrapper=wrapper,
            last_page_len_cpu=torch.ones(batch_size, dtype=torch.int32),
            qo_indptr_cpu=torch.arange(0, (batch_size + 1) * q_len, q_len, dtype=torch.int32),
        )

    def begin_graph(self, ga: CudaGraphAttention, kv_indptr_cpu: np.ndarray | None, kv_indices: torch.Tensor | None,
                    batch: ForwardBatch, num_kv_rows: int) -> None:
        """Get a graph's attention ready for `num_kv_rows` kv rows over its (padded)
        requests. For Triton the caller has copied kv_indptr and kv_indices into `batch`
        (the static batch the captured forward reads) and nothing else is needed; for
        flashinfer this plans the graph's wrapper from kv_indptr_cpu [B+1] and kv_indices
        [num_kv_rows] on the device.
        """
        if num_kv_rows > ga.max_kv_rows:
            raise ValueError(f"{num_kv_rows} kv rows exceed the graph's {ga.max_kv_rows}")
        if ga.wrapper is None:
            self._active = _Active(batch, num_splits=ga.num_splits)
            return
        kv_indptr = _host_i32(kv_indptr_cpu)
        if ga.q_len == 1:
            self._plan_decode(ga.wrapper, kv_indptr, kv_indices, ga.last_page_len_cpu)
        else:
            self._plan_prefill(ga.wrapper, ga.qo_indptr_cpu, kv_indptr, kv_indices, ga.last_page_len_cpu)
        self._active = _Active(batch, wrapper=ga.wrapper)

    # ---- per layer ------------------------------------------------------------

    def attend(self, layer_idx: int, q: torch.Tensor, kv: KVCache, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the pool, whose rows for the new tokens are
        already written (by `forward`, or by the fused RoPE kernel)."""
        active = self._active
        if active is None or active.batch is not batch:
            raise ValueError("CudaAttentionBackend.begin(batch) must be called before forward for that batch")
        k_cache = kv.k_cache[layer_idx]  # [rows, Hkv, D]
        v_cache = kv.v_cache[layer_idx]
        if active.wrapper is None:
            tr = batch.tree
            return paged_attention(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices,
                                   q_len=batch.max_q_len, num_splits=active.num_splits, scale=self.scale,
                                   tree=None if tr is None else (tr.prefix_len, tr.lo, tr.hi))
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # NHD pages of one row: [rows, 1, Hkv, D]
        return active.wrapper.run(q.contiguous(), paged)
