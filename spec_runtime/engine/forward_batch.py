"""Per-forward metadata: ragged queries over a token-granular KV pool.

Every forward either process runs (prefill, decode, K+1-token verify, the SSD glue,
and one step of SSD tree decode) is the same thing: R requests, request r brings
q_r new tokens and attends to an explicit list of KV-pool rows (its own new tokens
included, last). The attention rule is causal, aligned bottom-right:

    query i of request r (q_len q, kv_len n) sees kv rows [0, n - q + i]

so prefill (q = n), decode (q = 1), verify (q = K+1) and a tree branch (q = 1, its
rows = the sequence's prefix rows up to its fork point + its own scratch rows) need
no other mask. On CUDA this is flashinfer's paged attention with page_size 1 (the
row list is the page table); on the CPU it is SDPA over gathered rows.

The KV pool is laid out in one of two ways. `PagedLayout` (both processes): fixed-size
blocks that sequences take as they grow, with a block table each
(engine/kv_blocks.py), then scratch rows (the draft's SSD branches). `SlotLayout` (tests
and tools that want fixed rows): sequence slot s owns rows
[s * max_model_len, (s + 1) * max_model_len), so the row of position p is
s * max_model_len + p; scratch rows follow the slots. Either way a rejected token is
undone by moving the length, never by copying.

A tree step (SSD) replaces the causal rule with a shared-prefix mask, `TreeMask`: a
request is one sequence and its q tokens are its branches; its kv rows are the
sequence's prefix, then each branch's own rows. Token t sees the prefix
[0, prefix_len) and its own window [lo_t, hi_t) of the request's rows, so the prefix
is read once per sequence however many branches attend to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from spec_runtime.engine.staging import upload_int64


@dataclass(frozen=True)
class SlotLayout:
    num_slots: int
    max_model_len: int
    num_scratch_rows: int = 0

    @property
    def num_rows(self) -> int:
        return self.num_slots * self.max_model_len + self.num_scratch_rows

    @property
    def scratch_base(self) -> int:
        return self.num_slots * self.max_model_len

    def slot_rows(self, slot: int, length: int) -> np.ndarray:
        """Rows of positions [0, length) of a slot."""
        base = slot * self.max_model_len
        return np.arange(base, base + length, dtype=np.int64)


@dataclass(frozen=True)
class PagedLayout:
    """A pool of num_blocks blocks of block_size rows, then num_scratch_rows rows (SSD
    branches); which sequence holds which block is kv_blocks.KVBlocks' business."""

    num_blocks: int
    block_size: int
    max_model_len: int
    num_scratch_rows: int = 0

    @property
    def num_rows(self) -> int:
        return self.num_blocks * self.block_size + self.num_scratch_rows

    @property
    def scratch_base(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class ForwardItem:
    """One request of a forward, described on the host.

    token_ids are placed at positions [start_pos, start_pos + len(token_ids)).
    kv_rows lists the pool rows of positions [0, start_pos + len(token_ids)) as this
    request sees them, in position order; its last len(token_ids) entries are where
    the new tokens' K/V are written.
    logits: "last" (one row), "all" (one row per new token) or "none".
    num_pad: trailing tokens that only fill a CUDA graph's shape (cuda_graphs.pad_to_graph):
    they return no logits, so "all" gives one row per token before them.
    """

    token_ids: Sequence[int] | np.ndarray
    start_pos: int
    kv_rows: np.ndarray
    logits: str = "last"
    num_pad: int = 0


@dataclass
class TreeMask:
    """Shared-prefix attention of a tree step; row offsets are within a request's kv rows."""

    prefix_len: torch.Tensor  # [R] int32: rows [0, prefix_len) are seen by every token of the request
    lo: torch.Tensor  # [T] int32: token t also sees rows [lo[t], hi[t])
    hi: torch.Tensor  # [T] int32
    prefix_len_cpu: np.ndarray  # [R] host copies, for the CPU backend's mask
    lo_cpu: np.ndarray  # [T]
    hi_cpu: np.ndarray | None  # [T]; None: only on the device (a step whose forks the device chose)
    advance: torch.Tensor  # [T] int64: 1 for a real branch (moves on each step), 0 for padding
    advance_cpu: np.ndarray  # [T]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_write_rows: torch.Tensor  # [T] int64: pool row of each new token's K/V
    qo_indptr: torch.Tensor  # [R+1] int32: request r's tokens are [qo_indptr[r], qo_indptr[r+1])
    kv_indptr: torch.Tensor  # [R+1] int32
    kv_indices: torch.Tensor  # [nnz] int32: rows request r attends to, position order
    logits_indices: torch.Tensor  # [N] int64: token indices whose logits are returned
    # Host copies, for backends that plan on the CPU (flashinfer) and for the SDPA loop.
    qo_indptr_cpu: np.ndarray
    kv_indptr_cpu: np.ndarray
    max_q_len: int
    # Optional logits transform of the synthetic acceptance oracle (benchmarks only):
    # the absolute position and oracle seed of each logits row.
    logits_positions_cpu: np.ndarray | None = None
    tree: TreeMask | None = None  # a tree step's mask; None: the causal rule

    @property
    def num_requests(self) -> int:
        return len(self.qo_indptr_cpu) - 1

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1


def build_forward_batch(items: Sequence[ForwardItem], device: torch.device | str) -> ForwardBatch:
    """Flatten items into one ForwardBatch, its arrays in one host-to-device copy."""
    if not items:
        raise ValueError("a forward needs at least one request")
    q_lens = np.fromiter((len(it.token_ids) for it in items), dtype=np.int64, count=len(items))
    kv_lens = np.fromiter((len(it.kv_rows) for it in items), dtype=np.int64, count=len(items))
    if (q_lens < 1).any():
        raise ValueError("every request needs at least one new token")
    starts = np.fromiter((it.start_pos for it in items), dtype=np.int64, count=len(items))
    if (kv_lens != starts + q_lens).any():
        raise ValueError("kv_rows must cover positions [0, start_pos + len(token_ids))")

    qo_indptr = np.zeros(len(items) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qo_indptr[1:])
    kv_indptr = np.zeros(len(items) + 1, dtype=np.int32)
    np.cumsum(kv_lens, out=kv_indptr[1:])

    input_ids = np.concatenate([np.asarray(it.token_ids, dtype=np.int64) for it in items])
    positions = np.concatenate([np.arange(s, s + q, dtype=np.int64) for s, q in zip(starts, q_lens)])
    kv_indices = np.concatenate([np.asarray(it.kv_rows, dtype=np.int64) for it in items])
    write_rows = np.concatenate([np.asarray(it.kv_rows[-q:], dtype=np.int64) for it, q in zip(items, q_lens)])

    logit_idx: list[np.ndarray] = []
    for it, lo, hi in zip(items, qo_indptr[:-1], qo_indptr[1:]):
        if it.logits == "last":
            logit_idx.append(np.array([hi - 1], dtype=np.int64))
        elif it.logits == "all":
            logit_idx.append(np.arange(lo, hi - it.num_pad, dtype=np.int64))
        elif it.logits != "none":
            raise ValueError(f"logits must be last, all or none, got {it.logits!r}")
    logits_indices = np.concatenate(logit_idx) if logit_idx else np.zeros(0, dtype=np.int64)

    # input_ids, positions and kv_write_rows back to back: the graph runner refills all three in one copy.
    ids_d, pos_d, write_d, logit_d, qo_d, kv_d, kvi_d = upload_int64(
        (input_ids, positions, write_rows, logits_indices, qo_indptr, kv_indptr, kv_indices), device, int32_tail=3,
        packed=3)

    return ForwardBatch(
        input_ids=ids_d,
        positions=pos_d,
        kv_write_rows=write_d,
        qo_indptr=qo_d,
        kv_indptr=kv_d,
        kv_indices=kvi_d,
        logits_indices=logit_d,
        qo_indptr_cpu=qo_indptr,
        kv_indptr_cpu=kv_indptr,
        max_q_len=int(q_lens.max()),
        logits_positions_cpu=positions[logits_indices] if len(logits_indices) else positions[:0],
    )


@dataclass
class TreeBranch:
    """One branch of a tree step: its first token, and the rows only it sees.

    local_rows: the branch's own kv rows in position order after the shared prefix
    (the accepted drafts it forked after, then its scratch rows); the first
    num_visible of them are seen at step 0, one more at each later step, and the
    new token's K/V goes to local_rows[num_visible - 1].
    """

    token_id: int
    position: int
    local_rows: np.ndarray
    num_visible: int


def build_tree_batch(prefixes: Sequence[np.ndarray], branches: Sequence[Sequence[TreeBranch]], q_len: int,
                     dummy_row: int, device: torch.device | str) -> ForwardBatch:
    """Step 0 of a tree decode: request r attends to prefixes[r] (shared by all its
    branches) and each of its q_len tokens to its own rows. Requests with fewer than
    q_len branches are padded with tokens that write to and read `dummy_row` only;
    `tree_step_batch` derives the later steps on the device. Logits: every token."""
    if not prefixes or len(prefixes) != len(branches):
        raise ValueError("a tree step needs one prefix per request and at least one request")
    flat = [br for brs in branches for br in brs]
    width = max((len(br.local_rows) for br in flat), default=1)
    local = np.zeros((len(flat), width), dtype=np.int64)
    for i, br in enumerate(flat):
        local[i, : len(br.local_rows)] = br.local_rows
    return tree_arrays(prefixes, np.repeat(np.arange(len(branches)), [len(b) for b in branches]),
                       np.array([br.token_id for br in flat], dtype=np.int64),
                       np.array([br.position for br in flat], dtype=np.int64), local,
                       np.array([len(br.local_rows) for br in flat], dtype=np.int64),
                       np.array([br.num_visible for br in flat], dtype=np.int64), q_len, dummy_row).upload(device)


@dataclass
class TreeArrays:
    """A tree step's inputs on the host (tree_arrays), before `upload` makes its ForwardBatch."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    write_rows: np.ndarray  # [T] int64
    advance: np.ndarray  # [T] int64: 1 for a real branch, 0 for padding
    qo_indptr: np.ndarray  # [R+1] int32
    kv_indptr: np.ndarray  # [R+1] int32
    kv_indices: np.ndarray  # [nnz] int64
    lo: np.ndarray  # [T] int32: TreeMask's windows, within the request's kv rows
    hi: np.ndarray  # [T] int32
    prefix_len: np.ndarray  # [R] int32
    token: np.ndarray  # [F] each branch's index among the T tokens
    q_len: int

    def upload(self, device: torch.device | str) -> ForwardBatch:
        return self.upload_with(device, ())[0]

    def upload_with(self, device: torch.device | str,
                    extra: Sequence[np.ndarray]) -> tuple[ForwardBatch, list[torch.Tensor]]:
        """The step's ForwardBatch, and `extra` int64 arrays on the device, in one copy."""
        t = len(self.input_ids)
        ids_d, pos_d, write_d, adv_d, logit_d, *rest = upload_int64(
            (self.input_ids, self.positions, self.write_rows, self.advance, np.arange(t), *extra, self.qo_indptr,
             self.kv_indptr, self.kv_indices, self.lo, self.hi, self.prefix_len), device, int32_tail=6, packed=3)
        extra_d, (qo_d, kv_d, kvi_d, lo_d, hi_d, plen_d) = rest[: len(extra)], rest[len(extra):]
        batch = ForwardBatch(
            input_ids=ids_d, positions=pos_d, kv_write_rows=write_d, qo_indptr=qo_d, kv_indptr=kv_d,
            kv_indices=kvi_d, logits_indices=logit_d, qo_indptr_cpu=self.qo_indptr, kv_indptr_cpu=self.kv_indptr,
            max_q_len=self.q_len, logits_positions_cpu=self.positions,
            tree=TreeMask(prefix_len=plen_d, lo=lo_d, hi=hi_d, prefix_len_cpu=self.prefix_len, lo_cpu=self.lo,
                          hi_cpu=self.hi, advance=adv_d, advance_cpu=self.advance),
        )
        return batch, extra_d


def tree_arrays(prefixes: Sequence[np.ndarray], request: np.ndarray, token_ids: np.ndarray, positions: np.ndarray,
                local_rows: np.ndarray, local_len: np.ndarray, num_visible: np.ndarray, q_len: int,
                dummy_row: int) -> TreeArrays:
    """build_tree_batch's inputs on the host, from arrays over the branches (F of them,
    request by request, in branch order): each one's request [F], first token and position
    [F], own rows local_rows[f, :local_len[f]] ([F, L], TreeBranch.local_rows) and
    num_visible [F]. No host work per branch beyond array operations."""
    r = len(prefixes)
    counts = np.bincount(request, minlength=r) if len(request) else np.zeros(r, dtype=np.int64)
    if len(counts) != r or counts.min() < 1 or counts.max() > q_len:
        raise ValueError(f"every request needs 1 to q_len={q_len} branches")
    if ((num_visible < 1) | (num_visible > local_len)).any():
        raise ValueError("num_visible outside [1, len(local_rows)]")
    t = r * q_len
    tok = request * q_len + (np.arange(len(request)) - np.repeat(np.cumsum(counts) - counts, counts))
    input_ids, pos, advance = np.zeros(t, dtype=np.int64), np.zeros(t, dtype=np.int64), np.zeros(t, dtype=np.int64)
    input_ids[tok], pos[tok], advance[tok] = token_ids, positions, 1
    write_rows = np.full(t, dummy_row, dtype=np.int64)
    write_rows[tok] = local_rows[np.arange(len(tok)), num_visible - 1]
    lens, visible = np.ones(t, dtype=np.int64), np.ones(t, dtype=np.int64)  # padding: its one dummy row
    lens[tok], visible[tok] = local_len, num_visible
    rows = np.full((t, max(local_rows.shape[1], 1)), dummy_row, dtype=np.int64)
    rows[tok, : local_rows.shape[1]] = local_rows
    own = rows[np.arange(rows.shape[1])[None, :] < lens[:, None]]  # every token's rows, token by token
    prefix_len = np.array([len(p) for p in prefixes], dtype=np.int32)
    per_req = lens.reshape(r, q_len)
    lo = (prefix_len[:, None] + np.cumsum(per_req, axis=1) - per_req).ravel().astype(np.int32)
    hi = (lo + visible).astype(np.int32)
    own_ends = np.cumsum(per_req.sum(axis=1))
    pieces = []
    for i, prefix in enumerate(prefixes):
        pieces += [np.asarray(prefix, dtype=np.int64), own[own_ends[i] - per_req[i].sum() : own_ends[i]]]
    kv_indices = np.concatenate(pieces)
    kv_indptr = np.zeros(r + 1, dtype=np.int32)
    np.cumsum(prefix_len + per_req.sum(axis=1), out=kv_indptr[1:])
    return TreeArrays(input_ids, pos, write_rows, advance, np.arange(0, t + 1, q_len, dtype=np.int32), kv_indptr,
                      kv_indices, lo, hi, prefix_len, tok, q_len)


def tree_step_batch(first: ForwardBatch, step: int, input_ids: torch.Tensor) -> ForwardBatch:
    """Step `step` of the tree decode that `first` (build_tree_batch) starts: every real
    branch feeds `input_ids` (its token of the previous step, on the device) one
    position later, writes its next row and sees one more row. No host work in
    proportion to the context: three small device adds."""
    tr = first.tree
    if tr is None:
        raise ValueError("tree_step_batch needs a batch from build_tree_batch")
    t = first.input_ids.shape[0]
    packed = torch.empty(3, t, dtype=torch.int64, device=first.input_ids.device)  # ids, positions, write rows
    packed[0].copy_(input_ids)
    torch.add(first.positions, tr.advance, alpha=step, out=packed[1])
    torch.add(first.kv_write_rows, tr.advance, alpha=step, out=packed[2])
    hi = tr.hi + (tr.advance * step).to(torch.int32)
    return ForwardBatch(
        input_ids=packed[0], positions=packed[1], kv_write_rows=packed[2],
        qo_indptr=first.qo_indptr, kv_indptr=first.kv_indptr, kv_indices=first.kv_indices,
        logits_indices=first.logits_indices, qo_indptr_cpu=first.qo_indptr_cpu, kv_indptr_cpu=first.kv_indptr_cpu,
        max_q_len=first.max_q_len, logits_positions_cpu=_moved(first.logits_positions_cpu, step * tr.advance_cpu),
        tree=TreeMask(prefix_len=tr.prefix_len, lo=tr.lo, hi=hi, prefix_len_cpu=tr.prefix_len_cpu, lo_cpu=tr.lo_cpu,
                      hi_cpu=_moved(tr.hi_cpu, (step * tr.advance_cpu).astype(np.int32)), advance=tr.advance,
                      advance_cpu=tr.advance_cpu),
    )


def _moved(host: np.ndarray | None, by: np.ndarray) -> np.ndarray | None:
    return None if host is None else host + by
