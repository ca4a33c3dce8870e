"""The draft oracle's logits written on the GPU, in one kernel per transform.

oracle.py computes the draft's top slots at each (seed, position) with NumPy on the host
and scatters them into a [R, V] tensor of MASKED_LOGIT. On the draft that host work sits
where a real draft has none: between the SSD glue's forward and the forks it ranks for, and
before the tree steps' first sampling (a draft-1b work-ahead at batch 1 took 8.47 ms with
it and 6.68-6.78 ms without the oracle on an H200: docs/benchmarks.md, "The work-ahead's
host path"). `draft_logits` computes the same slots from the same
counter-based hash bits in a kernel (spec_runtime/kernels/race.py's `_row_key`, the
uniform's float64 value) and writes the whole rows, so a transform costs the host one
launch and the seeds' and positions' copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spec_runtime.kernels.race import _mix32, _row_key
from spec_runtime.sampling import _mix32 as mix32_host
from spec_runtime.sampling import stream_key

CHUNK = 4096
_INDEX0 = tl.constexpr(mix32_host(0x68E31DA4))  # hash32's mixed index 0


@triton.jit
def _hash0(key):
    """hash32 at index 0 for a row key."""
    return _mix32(key ^ _INDEX0)


@triton.jit(do_not_specialize=["vocab", "step", "num_bounds", "masked", "top", "gap", "tok_key", "rank_key",
                               "fill_key"],
            do_not_specialize_on_alignment=["seed_ptr", "pos_ptr"])
def _draft_logits_kernel(seed_ptr, pos_ptr, bounds_ptr, out_ptr, vocab, step, num_bounds, masked, top, gap,
                         tok_key, rank_key, fill_key, S: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    seed = tl.load(seed_ptr + r)
    pos = tl.load(pos_ptr + r) + step
    o = _hash0(_row_key(seed, pos, tok_key)) % vocab
    u = (_hash0(_row_key(seed, pos, rank_key)).to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
    b = tl.arange(0, NB)
    bounds = tl.load(bounds_ptr + b, mask=b < num_bounds, other=2.0)
    r0 = tl.sum((u >= bounds).to(tl.int64), 0)
    r0 = tl.where(r0 > num_bounds - 1, S, r0)  # absent: past every slot
    offset = _hash0(_row_key(seed, pos, fill_key)) % (vocab - 1)
    ids = c * CHUNK + tl.arange(0, CHUNK)
    val = tl.full([CHUNK], masked, tl.float32)
    for s in tl.static_range(S):
        fill_idx = tl.maximum(tl.where(s < r0, s, s - 1), 0)
        filler = (o + 1 + (offset + fill_idx) % (vocab - 1)) % vocab
        tok = tl.where(r0 == s, o, filler)
        val = tl.where(ids == tok, top - gap * s, val)
    tl.store(out_ptr + r.to(tl.int64) * vocab + ids, val.to(out_ptr.dtype.element_ty), mask=ids < vocab)


def draft_logits(like: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, bounds: torch.Tensor,
                 num_slots: int, masked: float, top: float, gap: float, streams: tuple[int, int, int],
                 step: int = 0) -> torch.Tensor:
    """oracle.draft_oracle_logits on the device: logits of like's shape [R, V] and dtype,
    MASKED except each row's slots. seeds, positions [R] int64 on like's device (row r
    predicts positions[r] + step); bounds [len(ranks) + 1] float64
    (oracle.cumulative_bounds); streams: the token's, the rank's and the fillers' hash streams."""
    r, vocab = like.shape
    out = torch.empty_like(like)
    if r:
        grid = (r, triton.cdiv(vocab, CHUNK))
        keys = [stream_key(s) for s in streams]
        _draft_logits_kernel[grid](seeds, positions, bounds, out, vocab, step, bounds.shape[0], masked, top, gap,
                                   *keys, S=num_slots, NB=max(2, triton.next_power_of_2(bounds.shape[0])),
                                   CHUNK=CHUNK)
    return out

