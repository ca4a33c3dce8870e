"""A work-ahead's forks chosen on the device, so the first tree step queues behind the glue.

Chosen on the host (tree_cache.select_forks_groups), the forks wait for the glue's ranking
to be read back: the GPU idles from the end of the glue's forward until the host has
chosen them and launched the first tree step. Here the same choice runs as device array
operations (`select_forks_device`: select_forks_batch's arithmetic in float64 and its
stable orders, for every sequence of the work-ahead at once), the first step is patched with the forks' depths and tokens on the device
(TreeLayout.batch_on_device), and the host reads the forks back while that step runs
(`DeviceForks.host`): the sampling positions, the benchmark oracle and the cache keys need
them only after step 0 is queued.

This needs the number of forks of each sequence before they are chosen, which a ranking
of at least F_j + 1 tokens at every depth j fixes (tree_layout.fork_count): `fits` checks it.
"""

from __future__ import annotations

import numpy as np
import torch

from draft_proc.tree_cache import Forks
from draft_proc.tree_layout import TreeLayout
from protocol.messages import PLACEHOLDER_TOKEN_ID
from spec_runtime.engine.forward_batch import to_host, upload_arrays
from spec_runtime.sampling import to_device


def ranking_width_needed(m: int, fan: tuple[int, ...]) -> int:
    """Ranked tokens per depth that give a sequence with m drafts fork_count forks: F_j + 1
    at a depth j < m (one may be d_{j+1}, which is excluded), F_m at depth m."""
    need = [fan[j] + (j < m) for j in range(min(m + 1, len(fan))) if fan[j] > 0]
    return max(need, default=0)


def fits(groups: dict[tuple[int, tuple[int, ...]], list[int]], ranking_width: int) -> bool:
    """Whether every group's forks come as many per sequence as fork_count says."""
    return all(ranking_width >= ranking_width_needed(m, fan) for m, fan in groups)


def select_forks_device(ids: torch.Tensor, probs: torch.Tensor, drafts: torch.Tensor, m: torch.Tensor,
                        want: torch.Tensor, max_branches: int, accept_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """select_forks_batch on device tensors, for sequences of any drafts counts at once:
    ids, probs [B, M + 1, R] each sequence's ranking at depths 0..M, drafts [B, M] (-1
    past its own count), m [B] its drafts count, want [B, M + 1] its fan-out F_j (0 past
    depth m[b], where its ranking rows are not read). Returns the forks' depths and tokens
    [B, W] in branch order: row b's first fork_count entries are select_forks_batch's for
    that sequence alone, the same values in the same order."""
    b, rows, width = ids.shape
    device = ids.device
    probs = probs.to(torch.float64)
    a = min(max(accept_rate, 1e-3), 1 - 1e-3)
    # Host constants go up through pinned memory: a pageable copy would wait for the glue.
    powers = to_device(torch.tensor([a**j for j in range(rows)], dtype=torch.float64), device)
    excluded = torch.full((b, rows), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    excluded[:, : rows - 1] = drafts
    match = ids == excluded[:, :, None]
    first = probs.gather(2, match.to(torch.uint8).argmax(dim=2, keepdim=True))[:, :, 0]
    q_excluded = torch.where(match.any(dim=2), first, 0.0)
    # Depth j < m excludes d_{j+1} and weighs by 1 - q_j(d_{j+1}); depth m is a^m.
    rejected = powers * (1 - a) / torch.clamp(1.0 - q_excluded, min=1e-6)
    scale = torch.where(torch.arange(rows, device=device)[None, :] < m[:, None], rejected, powers)
    usable = ~match & (ids >= 0)
    taken = usable & (torch.cumsum(usable, dim=2) <= want[:, :, None])
    est = torch.where(taken, scale[:, :, None] * probs, -torch.inf).reshape(b, -1)
    order = torch.sort(-est, dim=1, stable=True).indices[:, :max_branches]
    est_c = est.gather(1, order)
    depth_key = torch.where(torch.isfinite(est_c), order // width, rows)
    # numpy's lexsort((-est_c, depth_key)) as two stable sorts, the minor key first.
    by_est = torch.sort(-est_c, dim=1, stable=True).indices
    by_depth = torch.sort(depth_key.gather(1, by_est), dim=1, stable=True).indices
    order = order.gather(1, by_est.gather(1, by_depth))
    return order // width, ids.reshape(b, -1).gather(1, order)


class DeviceForks:
    """The forks of one work-ahead in `layout`'s order (sequence by sequence, each one's in
    branch order): depth and token [F] on the device, their host copy on its way.

    groups: (m, fan-out) -> sequence indices (SSDEngine._fork_groups), `fits` the ranking;
    ranked: the glue's ranking (ids, probs [sum(m + 1), R] on the device, each sequence's
    first row [B]); seqs: DraftSeq, their draft_token_ids."""

    def __init__(self, groups, seqs, ranked, layout: TreeLayout, per_seq: int, accept_rate: float):
        ids, probs, starts = ranked
        device = ids.device
        b, width = len(seqs), ids.shape[1]
        m = np.array([len(s.draft_token_ids) for s in seqs], dtype=np.int64)
        depths = int(m.max()) + 1
        drafts = np.full((b, depths - 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        want = np.zeros((b, depths), dtype=np.int64)
        for (mg, fan), idx in groups.items():
            f = np.array(fan[: mg + 1], dtype=np.int64)
            want[np.asarray(idx)[:, None], np.arange(len(f))] = f
            if mg:
                drafts[idx, :mg] = [seqs[i].draft_token_ids for i in idx]
        rows = starts[:, None] + np.minimum(np.arange(depths)[None, :], m[:, None])  # [B, depths] of the ranking
        w = min(per_seq, depths * width)  # select_forks_device's columns
        rows, drafts, m, want, src = upload_arrays((rows.ravel(), drafts.ravel(), m, want.ravel(),
                                                    layout.seq * w + layout.branch), device)
        d, t = select_forks_device(ids[rows].view(b, depths, width), probs[rows].view(b, depths, width),
                                   drafts.view(b, depths - 1), m, want.view(b, depths), per_seq, accept_rate)
        out = torch.stack((d.reshape(-1)[src], t.reshape(-1)[src]))  # [2, F]: depths, tokens
        self.depth, self.token = out[0], out[1]
        (self._host,), self._copied = to_host(out)
        self._layout, self._forks = layout, None

    def host(self) -> Forks:
        """The forks on the host, also written into the layout's host arrays (TreeLayout.fill_host);
        waits for their copy, not for the work queued after it."""
        if self._forks is None:
            if self._copied is not None:
                self._copied.synchronize()  # sync: the forks' copy only
            h = self._host.numpy()
            self._forks = Forks(seq=self._layout.seq, depth=h[0].copy(), token_id=h[1].copy(),
                                branch=self._layout.branch)
            self._layout.fill_host(self._forks)
        return self._forks
