"""One Triton kernel for the draft's exponential race over its top tokens.

`spec_runtime.sampling.draft_sample` picks the draft token from its truncated q by an
exponential race keyed by (seed, position, STREAM_DRAFT, token id): argmax q / E with
E = -log(u), u from the counter-based hash (`sampling.hash32`). In torch that is several
dozen elementwise kernels per draft token, each launched from the host between the graph
replays of a chain, and a sampled chain is then host-bound (docs/benchmarks.md, "Plain
steps that keep the draft current"). `draft_race` does the same integer and float
operations in one program per row: the same bits for E (int64 hash, float64 log, then
float32), the same first-maximum rule as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = (((x >> 16) ^ x) * 0x045D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x045D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _draft_race_kernel(seed_ptr, pos_ptr, ids_ptr, probs_ptr, out_ptr, m, stream_key, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    seed = tl.load(seed_ptr + r)
    pos = tl.load(pos_ptr + r)
    key = _mix32((seed & 0xFFFFFFFF) ^ stream_key)
    key = _mix32(key ^ ((((seed >> 32) & 0xFFFFFFFF) + (pos & 0xFFFFFFFF) * 0x61C88647) & 0xFFFFFFFF))
    offs = tl.arange(0, BLOCK)
    mask = offs < m
    ids = tl.load(ids_ptr + r * m + offs, mask=mask, other=0)
    q = tl.load(probs_ptr + r * m + offs, mask=mask, other=0.0)
    h = _mix32(_mix32(((ids & 0xFFFFFFFF) * 0x61C88647 + 0x68E31DA4) & 0xFFFFFFFF) ^ key)
    e = (-tl.log((h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0))).to(tl.float32)
    score = tl.where(mask, q / e, -1.0)
    best = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(out_ptr + r, tl.sum(tl.where(offs == best, ids, 0), axis=0))


def draft_race(seeds: torch.Tensor, positions: torch.Tensor, stream_key: int, q_token_ids: torch.Tensor,
               q_probs: torch.Tensor) -> torch.Tensor:
    """The token each row's race picks: seeds, positions [R] int64, q_token_ids [R, M]
    int64, q_probs [R, M] float32 -> [R] int64, as sampling.draft_race_torch with the
    stream whose key (sampling.stream_key) is stream_key."""
    r, m = q_token_ids.shape
    out = torch.empty(r, dtype=torch.int64, device=q_token_ids.device)
    if r:
        _draft_race_kernel[(r,)](seeds.long().contiguous(), positions.long().contiguous(),
                                 q_token_ids.contiguous(), q_probs.float().contiguous(), out, m, stream_key,
                                 BLOCK=triton.next_power_of_2(m))
    return out
