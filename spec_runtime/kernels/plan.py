"""One model's kernel choices: made once at start-up, read by its layers on every forward.

`KernelPlan` is per-runner state (not a process-wide switch): the runner builds it from
the frozen `KernelConfig` and the device, the tuning step fills in the one-token
projection choice and its block sizes, and every layer of the model holds the same
plan object. Nothing here imports torch or triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# (BLOCK_N, BLOCK_K, num_warps) of the one-token projection kernel.
Block = tuple[int, int, int]
# Rows (tokens) the one-token projection kernel takes: a decode or draft step of one sequence.
ONE_TOKEN_ROWS = 1


class BlockTable:
    """The block sizes tuning chose, per projection shape (weight rows, K, norm, silu_mul)."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[int, int, bool, bool], Block] = {}

    def get(self, weight_rows: int, k: int, *, norm: bool, silu_mul: bool) -> Block | None:
        """The tuned block of this shape, or None (the kernel's default applies)."""
        return self._blocks.get((weight_rows, k, norm, silu_mul))

    def set(self, weight_rows: int, k: int, *, norm: bool, silu_mul: bool, block: Block | None) -> None:
        """Use `block` for this shape (None: back to the default)."""
        key = (weight_rows, k, norm, silu_mul)
        if block is None:
            self._blocks.pop(key, None)
        else:
            self._blocks[key] = block

    def is_tuned(self, weight_rows: int, k: int, *, norm: bool, silu_mul: bool) -> bool:
        return (weight_rows, k, norm, silu_mul) in self._blocks


@dataclass
class KernelPlan:
    """What one model's forward runs.

    fused: torch.compile'd RMSNorm/add-RMSNorm, SiLU-and-mul and RoPE cos/sin, and the
      Triton q/k-norm + RoPE + KV-write kernel (CUDA only; False: eager torch ops).
    small_linear: one-token forwards run the Triton projection kernel with the norms,
      residual adds and SiLU-and-mul folded in (needs `fused`).
    blocks: that kernel's tuned block sizes.
    """

    fused: bool = False
    small_linear: bool = False
    blocks: BlockTable = field(default_factory=BlockTable)

    def folds_one_token(self, num_tokens: int) -> bool:
        """Whether a forward of num_tokens tokens runs the folded one-token projections."""
        return self.fused and self.small_linear and num_tokens <= ONE_TOKEN_ROWS
