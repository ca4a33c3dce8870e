"""A work-ahead's forks chosen on the device, so that its tree decode starts without a sync.

The glue ranks each sequence's candidates on the GPU. Chosen on the host
(tree_cache.select_forks_groups), the forks wait for that ranking to come back: the host
waits for the glue's forward, then the GPU waits while the host chooses and writes the
first tree step's inputs. The TreeLayout laid out while the glue runs already fixes how
many forks each sequence gets (tree_layout.fork_count), so the choice can stay where the
ranking is: `choose_on_device` chooses what select_forks_batch chooses (the same
estimates in float64, the same stable orders) and writes what TreeLayout.batch writes
into the step's inputs on the device, in one kernel on CUDA (spec_runtime/kernels/forks.py)
and in the torch statement below elsewhere (`select_forks_device`, `write_first_step`: what
the kernel is tested against). The host reads the forks back with the tree's tokens, at
the tree decode's one sync.

A sequence whose ranking holds fewer usable candidates than fork_count gets forks no
outcome can reach (an estimate of -inf); `valid` marks the others, and only they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draft_proc.tree_cache import Forks
from draft_proc.tree_layout import TreeLayout
from protocol.messages import PLACEHOLDER_TOKEN_ID
from spec_runtime.engine.forward_batch import ForwardBatch

# The arrays of one choice, in the order of their upload (per sequence, then per fork).
_FIELDS = ("start", "m", "count", "f0", "want", "excl", "numer", "tok", "own", "n", "scratch", "lo", "acc", "seq",
           "branch")


@dataclass
class DeviceForks:
    """Forks [F] in a TreeLayout's order: sequence and branch index on the host (the
    layout's); on the device their table [4, F] int64 (depth, token, rank by estimate,
    valid 0/1), the first tree step written with them, and each fork's token index in it."""

    seq: np.ndarray
    branch: np.ndarray
    table: torch.Tensor
    first: ForwardBatch
    token_index: torch.Tensor

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def depth(self) -> torch.Tensor:
        return self.table[0]

    @property
    def token_id(self) -> torch.Tensor:
        return self.table[1]

    def to_host(self) -> tuple[Forks, np.ndarray]:
        """The forks on the host (a sync), and which of them are valid [F] bool."""
        d = self.table.cpu().numpy()
        return Forks(seq=self.seq, depth=d[0], token_id=d[1], branch=self.branch, rank=d[2]), d[3].astype(bool)


def _inputs(groups, drafts: list[list[int]], per_seq: int, accept_rate: float, starts: np.ndarray, width: int,
            layout: TreeLayout) -> tuple[list[np.ndarray], int] | None:
    """The host arrays of a choice (_FIELDS) and the depths they cover, or None where some
    sequence has more forks than its ranking has candidates."""
    b = len(drafts)
    m = np.array([len(d) for d in drafts], dtype=np.int64)
    counts = np.bincount(layout.seq, minlength=b)
    if (counts > np.minimum(per_seq, (m + 1) * width)).any():
        return None
    depths = int(m.max()) + 1
    j = np.arange(depths)
    excl = np.full((b, depths), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    want = np.zeros((b, depths), dtype=np.int64)
    for (_, fan), idx in groups.items():
        f = np.zeros(depths, dtype=np.int64)
        f[: min(len(fan), depths)] = fan[:depths]
        for i in idx:
            excl[i, : m[i]] = drafts[i]
            want[i, : m[i] + 1] = f[: m[i] + 1]
    # select_forks' estimate: a^j (1 - a) q_j(t) / (1 - q_j(d_{j+1})) below m, a^m q_m(t) at m.
    a = min(max(accept_rate, 1e-3), 1 - 1e-3)
    powers = np.array([a**i for i in range(depths)])
    numer = np.where(j[None, :] < m[:, None], powers * (1 - a), powers)
    a_ = layout.arrays
    return [starts, m, counts, np.cumsum(counts) - counts, want.ravel(), excl.ravel(), numer.ravel().view(np.int64),
            a_.token, layout.own, layout.n, layout.scratch, a_.lo[a_.token].astype(np.int64), layout.accepted.ravel(),
            layout.seq, layout.branch], depths


def rank(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The glue's ranking, topk(softmax(logits), width): ids and probs [N, width], in two
    kernels on a GPU (spec_runtime/kernels/rank.py)."""
    if logits.is_cuda:
        from spec_runtime.kernels.rank import top_probs

        return top_probs(logits, width)
    top = torch.topk(torch.softmax(logits.float(), dim=-1), width, dim=-1)
    return top.indices, top.values


def choose_on_device(ranked: tuple[torch.Tensor, torch.Tensor, np.ndarray], groups, drafts: list[list[int]],
                     per_seq: int, accept_rate: float, layout: TreeLayout) -> DeviceForks | None:
    """The forks of B sequences chosen where the glue's ranking lies, and the layout's first
    tree step written with them. ranked: ids and probs [N, R] on the device (sequence b's
    depth j in row starts[b] + j) and starts [B]; groups: (m, fan-out) -> the sequences
    that fork with it; drafts: each sequence's speculation; per_seq: the branch budget;
    layout: the step laid out for fork_count forks a sequence. None where the host must
    choose (a ranking narrower than a sequence's forks)."""
    ids, probs, starts = ranked
    host = _inputs(groups, drafts, per_seq, accept_rate, starts, ids.shape[1], layout)
    if host is None:
        return None
    arrays, depths = host
    first, views = layout.arrays.upload_with(ids.device, arrays)  # the step and the choice's arrays in one copy
    v = dict(zip(_FIELDS, views))
    v["numer"] = v["numer"].view(torch.float64)
    if ids.is_cuda:
        from spec_runtime.kernels.forks import fork_and_lay_out

        step = (first.input_ids, first.positions, first.tree.hi, first.kv_indices)
        table = fork_and_lay_out(ids, probs, v, step, len(drafts), depths, layout.k, layout.width, layout.dummy_row)
        first.tree.hi_cpu = first.logits_positions_cpu = None  # what the forks decide is on the device only
    else:
        depth, token, rank, valid = select_forks_device(ids, probs, v, per_seq, depths)
        write_first_step(first, v, depth, token, layout)
        table = torch.stack([depth, token, rank, valid.to(torch.int64)])
    return DeviceForks(layout.seq, layout.branch, table, first, v["tok"])


def warm_up(runner, spec_cfg) -> None:
    """Compile the ranking's and the choice's kernel variants on the runner's GPU now, not in
    the first work-aheads that meet them (spec_runtime/kernels/rank.py, forks.py); the time
    is a start-up phase."""
    import time

    from spec_runtime.kernels.forks import warm_up as compile_forks
    from spec_runtime.kernels.rank import warm_up as compile_rank

    t0 = time.perf_counter()
    ranked = max(max(spec_cfg.fan_out_for(True)), max(spec_cfg.fan_out_for(False))) + 1  # the glue's ranking
    widest = max(ranked, spec_cfg.max_branches())  # m = 0 ranks a sequence's whole budget
    compile_rank(runner.device, runner.vocab_size, widest)
    compile_forks(runner.device, spec_cfg.k, widest)
    runner.startup_phases["fork_kernel_s"] = time.perf_counter() - t0


def select_forks_device(ids: torch.Tensor, probs: torch.Tensor, v: dict, per_seq: int, depths: int):
    """select_forks_batch in torch over every sequence at once, its drafts padded to
    `depths` rows (those past a sequence's m want nothing); v: choose_on_device's arrays.
    Returns the layout's forks' depth, token, rank and validity [F]."""
    b, width = v["m"].shape[0], ids.shape[1]
    shape = (b, depths)
    excl, want, numer, m = v["excl"].view(shape), v["want"].view(shape), v["numer"].view(shape), v["m"]
    j = torch.arange(depths, device=ids.device)[None, :]
    rows = v["start"][:, None] + torch.minimum(j, m[:, None])
    cand = ids[rows]  # [B, D, R]
    p = probs[rows].double()
    match = cand == excl[:, :, None]
    first = p.gather(2, match.to(torch.int32).argmax(2, keepdim=True))[:, :, 0]  # its first match's probability
    q_excluded = torch.where(match.any(2), first, 0.0)
    scale = torch.where(j < m[:, None], numer / torch.clamp_min(1.0 - q_excluded, 1e-6), numer)
    usable = ~match & (cand >= 0)
    taken = usable & (usable.cumsum(2) <= want[:, :, None])  # the first F_j usable per depth
    est = torch.where(taken, scale[:, :, None] * p, -torch.inf).reshape(b, -1)  # (depth, rank) order
    # The best per_seq by estimate (stable), then by depth (untaken last), as select_forks_batch.
    order = torch.sort(-est, dim=1, stable=True).indices[:, : min(per_seq, est.shape[1])]
    finite = torch.isfinite(est.gather(1, order))
    rank = torch.sort(torch.where(finite, order // width, depths), dim=1, stable=True).indices
    order = order.gather(1, rank)
    pick = (v["seq"], v["branch"])
    return ((order // width)[pick], cand.reshape(b, -1).gather(1, order)[pick], rank[pick],
            finite.gather(1, rank)[pick])


def write_first_step(first: ForwardBatch, v: dict, depth: torch.Tensor, token: torch.Tensor,
                     layout: TreeLayout) -> None:
    """TreeLayout.batch's writes on the device: each fork's token, position, window end
    and own rows (its accepted drafts, then its scratch rows), into `first` (the step as
    laid out, uploaded). The host copies of what the forks decide are refreshed where the
    device is the host."""
    tok = v["tok"]
    first.input_ids.index_copy_(0, tok, token)
    first.positions.index_copy_(0, tok, v["n"] + depth)
    first.tree.hi.index_copy_(0, tok, (v["lo"] + depth + 1).to(torch.int32))
    col = torch.arange(layout.width, device=depth.device)[None, :]
    d = depth[:, None]
    accepted = v["acc"].view(len(tok), layout.width)
    rows = torch.where(col < d, accepted,
                       torch.where(col < d + layout.k, v["scratch"][:, None] + col - d, layout.dummy_row))
    first.kv_indices.index_copy_(0, (v["own"][:, None] + col).ravel(), rows.ravel().to(torch.int32))
    if first.input_ids.device.type == "cpu":
        first.tree.hi_cpu = first.tree.hi.numpy()
        first.logits_positions_cpu = first.positions.numpy()
