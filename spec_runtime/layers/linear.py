"""Linear layers that know their tensor-parallel split and load their own shard.

- `ReplicatedLinear`: the whole weight on every rank.
- `ColumnParallelLinear`: output features split over ranks (no communication);
  `MergedColumnParallelLinear` (gate and up) and `QKVParallelLinear` (q, k and v) hold
  several checkpoint tensors side by side, each loaded by shard id.
- `RowParallelLinear`: input features split; the partial outputs are summed by
  `all_reduce` (nothing to do at tp_size 1).

Each layer has a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
slice of a checkpoint tensor into one of its parameters, and the fused layers list
their `shard_ids`, so a model's loader checks that every shard arrived. (The loader
is the module's, not an attribute of the parameter: `to_empty` off the meta device
makes new parameters.)

`forward` is F.linear (cuBLAS on CUDA), or on the CPU oneDNN's linear over a weight
packed once into the layout its kernels read (`pack_for_cpu`): there a product of a
few rows (a verify) costs little more than one row (a decode step), where MKL's sgemm
can take twice a one-row product's time (docs/kernels.md).

`forward_one_token` runs the Triton one-token kernel (kernels/small_linear.py) with an
RMSNorm before it, a SiLU-and-mul after it, or the residual add into its output folded
in; the model calls it only where its KernelPlan says so (kernels/plan.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.kernels.compiled import triton_kernels
from spec_runtime.kernels.plan import KernelPlan


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into `param` (cast to its dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    _copy(param.data, loaded)


def _copy(dst: torch.Tensor, src) -> None:
    """src: a tensor, or a checkpoint slice not read yet (models.loader.LazySlice)."""
    if not isinstance(src, torch.Tensor):
        src = src.materialize()
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight [out, in] in oneDNN's layout, for `project`. The layout
    is chosen for a few rows per product (decode, verify and tree steps)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(f"oneDNN packing takes a float32 CPU weight, got {weight.dtype} on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)


def project(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): over W packed by `pack_weight` where there is one, else F.linear."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_for_cpu(model: nn.Module) -> int:
    """Pack every linear layer's and LM head's weight of a float32 CPU model for oneDNN
    (each module's `pack_for_cpu`); the number of weights packed."""
    packable = [m for m in model.modules() if hasattr(m, "pack_for_cpu") and m is not model]
    for m in packable:
        m.pack_for_cpu()
    return len(packable)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum x over the tensor-parallel group, in place; nothing to do at tp_size 1."""
    if tp_size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


class LinearBase(nn.Module):
    """y = x W^T (+ b) over this rank's [out_local, in_local] slice of W."""

    shard_ids: tuple = ()  # the checkpoint tensors a fused weight is made of

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype, plan: KernelPlan,
                 tp_size: int = 1, tp_rank: int = 0, split_dim: int | None = None) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size {tp_size})")
        sizes = [output_size, input_size]
        if split_dim is not None:
            if sizes[split_dim] % tp_size:
                raise ValueError(f"{sizes[split_dim]} features do not split over {tp_size} ranks")
            sizes[split_dim] //= tp_size
        self.input_size, self.output_size = input_size, output_size
        self.tp_size, self.tp_rank, self.split_dim = tp_size, tp_rank, split_dim
        self.plan = plan
        self.weight = nn.Parameter(torch.empty(*sizes, dtype=dtype))
        self.packed_weight: torch.Tensor | None = None  # pack_for_cpu's copy of the weight
        # A row-parallel bias is whole on every rank and added once (rank 0).
        self.bias = nn.Parameter(torch.empty(sizes[0], dtype=dtype)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        dim = self.split_dim
        if dim is not None and dim < loaded.dim():
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        _copy(param.data, loaded)

    def pack_for_cpu(self) -> None:
        """Run `forward` through oneDNN over a packed copy of the weight; the plain weight
        is released (`weight` becomes None), so the model holds one copy."""
        self.packed_weight = pack_weight(self.weight)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.packed_weight, self.bias)

    def forward_one_token(self, x: torch.Tensor, *, norm: nn.Module | None = None, silu_mul: bool = False,
                          add_to: torch.Tensor | None = None, block=None) -> torch.Tensor:
        """x [1, K] through the Triton one-token kernel. norm: an RMSNorm applied to x
        first; silu_mul: the weight is [gate; up] and the result silu(gate) * up;
        add_to: [1, N] tensor the product is added to in place (and returned); block:
        (BLOCK_N, BLOCK_K, num_warps) for this call, else the plan's tuned block."""
        if self.tp_size != 1:
            raise ValueError("the one-token kernel runs at tp_size 1 only")
        kw = dict(norm_weight=norm.weight, eps=norm.eps) if norm is not None else {}
        return triton_kernels().small_linear(x, self.weight, bias=self.bias, silu_mul=silu_mul, add_to=add_to, block=block,
                            table=self.plan.blocks, **kw)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank's output is its slice."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, split_dim=0, **kw)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate and up), shard ids 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], **kw) -> None:
        super().__init__(input_size, sum(output_sizes), **kw)
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"{type(self).__name__} has shards 0..{len(self.output_sizes) - 1}, not {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight, shard ids "q", "k", "v"; heads split over ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kw) -> None:
        tp_size = kw.get("tp_size", 1)
        if num_heads % tp_size or num_kv_heads % tp_size:
            raise ValueError(f"{num_heads} q heads and {num_kv_heads} kv heads do not split over {tp_size} ranks")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, **kw)
        q, kv = num_heads * head_dim // tp_size, num_kv_heads * head_dim // tp_size
        self.shards = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}  # local (offset, size)
        self.shard_ids = ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"{type(self).__name__} has shards q, k, v, not {shard_id!r}")
        offset, size = self.shards[shard_id]
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are summed by all_reduce
    (reduce_results False: each rank returns its partial sum, for a caller that reduces)."""

    def __init__(self, input_size: int, output_size: int, *, reduce_results: bool = True, **kw) -> None:
        super().__init__(input_size, output_size, split_dim=1, **kw)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = project(x, self.weight, self.packed_weight, bias)
        return all_reduce(y, self.tp_size) if self.reduce_results else y
