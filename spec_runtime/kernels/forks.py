"""An SSD work-ahead's forks chosen, and its first tree step written, in one kernel.

draft_proc/fork_device.py states the choice in torch (select_forks_device, the torch
statement of tree_cache.select_forks_batch) and the step's writes (write_first_step);
in torch they are dozens of small kernels, each launched from the host, which took the
host 3 ms on an H200 host, longer than choosing on the host (docs/benchmarks.md, "Forks
chosen on the device"). `fork_and_lay_out` does both in one program per sequence, with
the same float64 estimates and the same orders:

  1. each candidate c (depth c // R, rank c % R of the glue's ranking) gets its estimate:
     the excluded draft's probability at its depth and how many usable candidates of
     its depth come up to it are counted over blocks of the candidates;
  2. its rank by estimate (ties by index: a stable sort) is counted the same way, and the
     `count` best are the sequence's forks;
  3. a fork's place among them follows (depth, rank), candidates of estimate -inf last;
  4. each fork's depth, token, rank and validity go to `out`, and its token, position,
     window end and own rows into the first tree step's inputs.

Blocks of candidates are read back from a scratch buffer the program wrote, after a
barrier. The per-sequence and per-fork arrays are views of one upload, so their pointers'
alignment and the counts are not specialized (as in race.py): one compiled kernel serves
every batch of a given padded size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_VIEWS = ["start_ptr", "m_ptr", "count_ptr", "f0_ptr", "want_ptr", "excl_ptr", "numer_ptr", "tok_ptr", "own_ptr",
          "n_ptr", "scratch_ptr", "lo_ptr", "acc_ptr", "ids_out_ptr", "pos_out_ptr", "hi_out_ptr", "kv_out_ptr"]


@triton.jit
def _candidates(ids_ptr, probs_ptr, excl_ptr, b, start, m, c, R, D):
    """Candidates c [N] of sequence b: in range, token, probability (float64), whether it
    is the excluded draft, whether usable, depth."""
    depth = c // R
    inr = (depth <= m) & (c < D * R)
    row = start + tl.minimum(depth, m)
    tid = tl.load(ids_ptr + row * R + c % R, mask=inr, other=0)
    p = tl.load(probs_ptr + row * R + c % R, mask=inr, other=0.0).to(tl.float64)
    ex = tl.load(excl_ptr + b * D + depth, mask=inr, other=-1)
    return inr, tid, p, inr & (tid == ex), inr & (tid != ex) & (tid >= 0), depth


@triton.jit(do_not_specialize=["R", "D", "K", "W", "F", "dummy"], do_not_specialize_on_alignment=_VIEWS)
def _fork_kernel(ids_ptr, probs_ptr, start_ptr, m_ptr, count_ptr, f0_ptr, want_ptr, excl_ptr, numer_ptr,
                 tok_ptr, own_ptr, n_ptr, scratch_ptr, lo_ptr, acc_ptr, est_ptr, key_ptr, out_ptr,
                 ids_out_ptr, pos_out_ptr, hi_out_ptr, kv_out_ptr, R, D, K, W, F, dummy,
                 CP: tl.constexpr, BLK: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(start_ptr + b)
    m = tl.load(m_ptr + b)
    c = tl.arange(0, CP)
    inr, tid, p, match, usable, depth = _candidates(ids_ptr, probs_ptr, excl_ptr, b, start, m, c, R, D)
    q_excluded = tl.zeros([CP], tl.float64)  # topk's ids are distinct: at most one match per depth
    seen = tl.zeros([CP], tl.int32)  # usable candidates of the same depth up to and including c
    for s in range(0, CP, BLK):
        c2 = s + tl.arange(0, BLK)
        _, _, p2, match2, usable2, depth2 = _candidates(ids_ptr, probs_ptr, excl_ptr, b, start, m, c2, R, D)
        same = depth[:, None] == depth2[None, :]
        q_excluded += tl.sum(tl.where(same & match2[None, :], p2[None, :], 0.0), axis=1)
        seen += tl.sum((same & usable2[None, :] & (c2[None, :] <= c[:, None])).to(tl.int32), axis=1)
    want = tl.load(want_ptr + b * D + depth, mask=inr, other=0)
    numer = tl.load(numer_ptr + b * D + depth, mask=inr, other=0.0)
    floor = tl.full([CP], 1e-6, tl.float64)  # in float64, as the host's estimate
    scale = tl.where(depth < m, numer / tl.maximum(1.0 - q_excluded, floor), numer)
    est = tl.where(usable & (seen <= want), scale * p, float("-inf"))
    tl.store(est_ptr + b * CP + c, est)
    tl.debug_barrier()
    rank = tl.zeros([CP], tl.int32)
    for s in range(0, CP, BLK):
        c2 = s + tl.arange(0, BLK)
        est2 = tl.load(est_ptr + b * CP + c2)
        ahead = (est2[None, :] > est[:, None]) | ((est2[None, :] == est[:, None]) & (c2[None, :] < c[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    chosen = rank < tl.load(count_ptr + b)
    finite = est > float("-inf")
    key = tl.where(chosen, tl.where(finite, depth, D) * CP + rank, (D + 1) * CP + c)
    tl.store(key_ptr + b * CP + c, key)
    tl.debug_barrier()
    place = tl.zeros([CP], tl.int32)
    for s in range(0, CP, BLK):
        key2 = tl.load(key_ptr + b * CP + s + tl.arange(0, BLK))
        place += tl.sum((key2[None, :] < key[:, None]).to(tl.int32), axis=1)
    f = tl.load(f0_ptr + b) + place
    tl.store(out_ptr + f, depth.to(tl.int64), mask=chosen)
    tl.store(out_ptr + F + f, tid, mask=chosen)
    tl.store(out_ptr + 2 * F + f, rank.to(tl.int64), mask=chosen)
    tl.store(out_ptr + 3 * F + f, finite.to(tl.int64), mask=chosen)
    # The first tree step (TreeLayout.batch's writes): token, position, window end, own rows.
    t = tl.load(tok_ptr + f, mask=chosen, other=0)
    tl.store(ids_out_ptr + t, tid, mask=chosen)
    tl.store(pos_out_ptr + t, tl.load(n_ptr + f, mask=chosen, other=0) + depth, mask=chosen)
    tl.store(hi_out_ptr + t, (tl.load(lo_ptr + f, mask=chosen, other=0) + depth + 1).to(tl.int32), mask=chosen)
    w = tl.arange(0, WP)[None, :]
    fill = chosen[:, None] & (w < W)
    accepted = tl.load(acc_ptr + f[:, None] * W + w, mask=fill, other=0)
    scratch = tl.load(scratch_ptr + f, mask=chosen, other=0)[:, None]
    d = depth[:, None]
    rows = tl.where(w < d, accepted, tl.where(w < d + K, scratch + w - d, dummy))
    tl.store(kv_out_ptr + tl.load(own_ptr + f, mask=chosen, other=0)[:, None] + w, rows.to(tl.int32), mask=fill)


def _tiles(depths: int, r: int, width: int) -> tuple[int, int]:
    """The candidates' and the own rows' padded sizes (constexpr: few, so few compiles)."""
    return max(64, triton.next_power_of_2(depths * r)), max(16, triton.next_power_of_2(width))


def fork_and_lay_out(ids: torch.Tensor, probs: torch.Tensor, views: dict, step: tuple, num_seqs: int, depths: int,
                     k: int, width: int, dummy_row: int) -> torch.Tensor:
    """The forks of num_seqs sequences, [4, F] int64 (depth, token, rank, valid), written
    into the first tree step's inputs `step` (input_ids, positions, tree window ends, kv
    indices, as TreeLayout laid them out). ids, probs [N, R]: the glue's ranking; views:
    fork_device's per-sequence arrays (start, m, count, f0 [B]; want, excl, numer
    [B * depths]) and per-fork arrays (tok, own, n, scratch, lo [F]; acc [F * width]) on
    the device; k: the tree's steps."""
    f, r = int(views["tok"].shape[0]), ids.shape[1]
    cp, wp = _tiles(depths, r, width)
    est = torch.empty((num_seqs, cp), dtype=torch.float64, device=ids.device)
    key = torch.empty((num_seqs, cp), dtype=torch.int32, device=ids.device)
    out = torch.empty((4, f), dtype=torch.int64, device=ids.device)
    v = views
    _fork_kernel[(num_seqs,)](
        ids, probs, v["start"], v["m"], v["count"], v["f0"], v["want"], v["excl"], v["numer"], v["tok"], v["own"],
        v["n"], v["scratch"], v["lo"], v["acc"], est, key, out, *step, r, depths, k, width, f, dummy_row,
        CP=cp, BLK=16, WP=wp, num_warps=4)
    return out


def warm_up(device, k: int, widest: int) -> None:
    """Compile (or load from Triton's cache) now every variant a work-ahead of up to k
    steps and rankings up to `widest` tokens wide can meet, not in the first work-ahead
    that needs one: one launch each, of one sequence that forks nothing."""
    top, _ = _tiles(k + 1, widest, 1)
    cps = [c for c in (64, 128, 256, 512, 1024, 2048) if c <= top]
    _, wp = _tiles(1, 1, 2 * k)
    for cp in cps:
        ids = torch.zeros((1, cp), dtype=torch.int64, device=device)
        ints = torch.zeros(32, dtype=torch.int64, device=device)
        views = {name: ints[i : i + 1] for i, name in enumerate(("start", "m", "count", "f0", "want", "excl", "tok",
                                                                  "own", "n", "scratch", "lo", "acc"))}
        views["numer"] = ints[20:21].view(torch.float64)
        step = (ints[24:25], ints[25:26], torch.zeros(1, dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
        fork_and_lay_out(ids, ids.float(), views, step, 1, 1, k, wp, 0)
    torch.cuda.synchronize(device)
