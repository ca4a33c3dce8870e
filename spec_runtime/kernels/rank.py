"""The glue's ranking: each row's `width` likeliest tokens and their probabilities.

SSDEngine's glue ranks the draft's distribution at every depth of a speculation,
torch.topk(torch.softmax(logits), width) over [N, V]. For a vocabulary of 128K, topk's
radix selection is a dozen small kernels, each launched from the host while the work-ahead's
first tree step waits for the forks the ranking decides. `top_probs` gives the same in two
kernels:

  1. per row and chunk of BLOCK logits, the chunk's maximum and its sum of exp(x - max),
     and its `width` largest logits with their indices (ties: the lower index first);
  2. per row, the `width` largest of those candidates (ties: the lower index, as the
     candidates come in index order) and their probabilities exp(x - M) / Z, M and Z the
     row's maximum and normaliser merged from the chunks'.

A logit of -inf is chosen only after every finite one, and still once at most, so a row
yields `width` distinct tokens as topk does (of probability 0 past its finite logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
# Below every finite float32 logit: what a logit of -inf ranks as, so that an index
# already chosen (set to -inf) is never chosen again.
_FLOOR = tl.constexpr(-3.0e38)


@triton.jit(do_not_specialize=["stride", "V", "C", "W"])
def _chunk_kernel(x_ptr, stride, V, cand_v_ptr, cand_i_ptr, stat_ptr, C, W, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = tl.arange(0, BLOCK)
    offs = c * BLOCK + idx
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - tl.maximum(m, _FLOOR)), 0.0), 0)
    base = row * C + c
    tl.store(stat_ptr + 2 * base, m)
    tl.store(stat_ptr + 2 * base + 1, s)
    key = tl.where(offs < V, tl.maximum(x, _FLOOR), float("-inf"))
    for w in range(W):
        v = tl.max(key, 0)
        i = tl.argmax(key, 0, tie_break_left=True)
        tl.store(cand_v_ptr + base * W + w, v)
        tl.store(cand_i_ptr + base * W + w, c * BLOCK + i)
        key = tl.where(idx == i, float("-inf"), key)


@triton.jit(do_not_specialize=["C", "W"])
def _merge_kernel(cand_v_ptr, cand_i_ptr, stat_ptr, C, ids_ptr, probs_ptr, W, CP: tl.constexpr, SP: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, CP)
    live = j < C * W
    key = tl.load(cand_v_ptr + row * C * W + j, mask=live, other=float("-inf"))
    ids = tl.load(cand_i_ptr + row * C * W + j, mask=live, other=0)
    k = tl.arange(0, SP)
    ms = tl.load(stat_ptr + 2 * (row * C + k), mask=k < C, other=float("-inf"))
    ss = tl.load(stat_ptr + 2 * (row * C + k) + 1, mask=k < C, other=0.0)
    top = tl.max(ms, 0)
    z = tl.sum(tl.where(ms > float("-inf"), ss * tl.exp(ms - top), 0.0), 0)
    for w in range(W):
        v = tl.max(key, 0)
        p = tl.argmax(key, 0, tie_break_left=True)
        tok = tl.sum(tl.where(j == p, ids, 0), 0)
        tl.store(ids_ptr + row * W + w, tok)
        tl.store(probs_ptr + row * W + w, tl.where(v > _FLOOR, tl.exp(v - top) / z, 0.0))
        key = tl.where(j == p, float("-inf"), key)


def top_probs(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(torch.softmax(logits.float(), -1), width): (ids [N, width] int64,
    probs [N, width] float32), logits [N, V] on a GPU (or under Triton's interpreter)."""
    n, v = logits.shape
    width = min(width, v)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(v, BLOCK)
    dev = logits.device
    cand_v = torch.empty((n, chunks * width), dtype=torch.float32, device=dev)
    cand_i = torch.empty((n, chunks * width), dtype=torch.int64, device=dev)
    stats = torch.empty((n, chunks, 2), dtype=torch.float32, device=dev)
    ids = torch.empty((n, width), dtype=torch.int64, device=dev)
    probs = torch.empty((n, width), dtype=torch.float32, device=dev)
    if n == 0:
        return ids, probs
    _chunk_kernel[(n, chunks)](logits, logits.stride(0), v, cand_v, cand_i, stats, chunks, width, BLOCK=BLOCK)
    cp, sp = _tiles(chunks, width)
    _merge_kernel[(n,)](cand_v, cand_i, stats, chunks, ids, probs, width, CP=cp, SP=sp)
    return ids, probs


def _tiles(chunks: int, width: int) -> tuple[int, int]:
    """The merge's padded sizes (constexpr): one compile per power of two of the width."""
    return triton.next_power_of_2(chunks) * triton.next_power_of_2(width), triton.next_power_of_2(chunks)


def warm_up(device, vocab: int, widest: int) -> None:
    """Compile (or load from Triton's cache) every variant a ranking of up to `widest`
    tokens over `vocab` logits meets, now rather than in the work-ahead that first needs one."""
    width = 1
    while True:
        top_probs(torch.zeros((1, vocab), dtype=torch.float32, device=device), min(width, widest))
        if width >= widest:
            break
        width *= 2
    torch.cuda.synchronize(device)
