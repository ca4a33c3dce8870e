"""CUDA graphs for the fixed-shape forwards: decode (q_len 1) and verify (q_len K+1).

One graph per (batch size, q_len): batch sizes 1, 2, 4, 8, 16, ... up to the maximum,
each q_len of `q_lens`. Graphs are captured largest first into one memory pool, so
the smaller ones reuse the largest one's activation memory. A graph replays the whole
model forward (embedding to final norm) and, given `logits_fn`,
the LM head over every token of the shape: one launch per step instead of a graph
plus an eager GEMM, a cast and a gather (~0.1 ms of host time at batch 1). Callers
pick the rows they asked for afterwards.

Static inputs: input_ids, positions, kv_write_rows, kv_indptr and kv_indices live in
buffers sized for the largest graph (every graph reads a prefix of them). With the
Triton attention (the default) that is all a replay needs; a backend that plans on
the host (GraphAttention.host_plan: flashinfer) also gets the padded kv_indptr before
replay. A batch of b requests runs on the smallest captured size B >= b;
the B - b padding requests write their K/V to `dummy_row`, a pool row no sequence
owns, and attend to it only. Shapes without a graph (ragged q_len, prefill, more
requests or kv rows than captured) return None and the caller runs eagerly.

No host sync on this path: inputs and the page table are copied device to device
(padding requests' entries are one device add); only flashinfer graphs plan, on the host.

Tree graphs (SSD tree steps, `tree_shapes`): one per (sequences, branches per
sequence), each request a sequence whose q_len tokens are its branches under the
shared-prefix mask (forward_batch.TreeMask, copied into static buffers like the rest);
a request attends to at most max_kv_len prefix rows plus `tree_local_rows` per branch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from spec_runtime.attention.base import AttentionBackend, GraphAttention
from spec_runtime.engine.forward_batch import ForwardBatch, ForwardItem, TreeMask

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, ... and max_batch_size itself, ascending."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch_size)
    return sizes


def graph_logits_bytes(max_batch_size: int, q_lens: Sequence[int], vocab_size: int,
                       tree_shapes: Sequence[tuple[int, int]] = ()) -> int:
    """Memory the graphs' float32 logits outputs take: one per (batch size, q_len) and
    one per tree shape (sequences, branches)."""
    tokens = sum(graph_batch_sizes(max_batch_size)) * sum(set(q_lens)) + sum(b * q for b, q in set(tree_shapes))
    return tokens * vocab_size * 4


def pad_to_graph(items: Sequence[ForwardItem], q_lens: Sequence[int], max_requests: int, dummy_row: int,
                 max_kv_len: int) -> Sequence[ForwardItem]:
    """Items padded to one captured q_len, so that a verify (or an SSD glue) whose
    speculations are shorter than K still replays a graph; unchanged when no graph fits.

    Only forwards that want every row's logits are padded, to the smallest q_len of
    `q_lens` that holds the longest item. A padding token repeats the item's last token
    one position later, writes its K/V to `dummy_row` (a row no sequence owns, so
    nothing real is overwritten) and returns no logits (ForwardItem.num_pad): the
    caller sees the rows of its own tokens only. The real tokens cannot see the padding
    (causal rule), so their logits are those of the unpadded forward.
    """
    if not items or len(items) > max_requests or any(it.logits != "all" or it.num_pad for it in items):
        return items
    longest = max(len(it.token_ids) for it in items)
    q = next((q for q in sorted(q_lens) if q >= longest), None)
    if q is None or all(len(it.token_ids) == q for it in items):
        return items
    if any(it.start_pos + q > max_kv_len for it in items):  # positions past the context: run eagerly
        return items
    padded = []
    for it in items:
        pad = q - len(it.token_ids)
        if pad == 0:
            padded.append(it)
            continue
        tokens = np.asarray(it.token_ids, dtype=np.int64)
        padded.append(ForwardItem(np.concatenate([tokens, np.full(pad, tokens[-1], dtype=np.int64)]), it.start_pos,
                                  np.concatenate([np.asarray(it.kv_rows, dtype=np.int64),
                                                  np.full(pad, dummy_row, dtype=np.int64)]),
                                  "all", num_pad=pad))
    return padded


@dataclass
class _Graph:
    batch_size: int
    q_len: int
    tree: bool
    graph: torch.cuda.CUDAGraph
    attn: GraphAttention
    batch: ForwardBatch  # static: views of the shared input buffers
    out: torch.Tensor  # [B * q_len, H] hidden or [B * q_len, V] logits, written by every replay


class CudaGraphRunner:
    """Captures and replays fixed-shape forwards; `run` returns None for shapes it lacks."""

    def __init__(self, forward_fn: ForwardFn, backend: AttentionBackend, *, max_batch_size: int,
                 q_lens: Sequence[int], max_kv_len: int, dummy_row: int, device: torch.device,
                 logits_fn: LogitsFn | None = None, tree_shapes: Sequence[tuple[int, int]] = (),
                 tree_local_rows: int = 0) -> None:
        if any(q < 1 for q in q_lens) or not q_lens:
            raise ValueError(f"q_lens must be >= 1 and non-empty, got {tuple(q_lens)}")
        if max_kv_len < max(q_lens):
            raise ValueError(f"max_kv_len {max_kv_len} is shorter than q_len {max(q_lens)}")
        self.forward_fn = forward_fn
        self.logits_fn = logits_fn
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.q_lens = tuple(sorted(set(q_lens)))
        self.max_kv_len = max_kv_len  # kv rows one request may attend to
        self.tree_shapes = tuple(sorted(set(tree_shapes)))
        self.tree_local_rows = tree_local_rows
        self.dummy_row = dummy_row
        self.device = device
        tree_tokens = max((b * q for b, q in self.tree_shapes), default=0)
        max_tokens = max(max(self.batch_sizes) * max(self.q_lens), tree_tokens)
        max_requests = max(self.batch_sizes + [b for b, _ in self.tree_shapes])
        # input_ids, positions and kv_write_rows as the rows of one buffer: a batch built
        # by build_forward_batch holds them back to back, so one copy refills all three.
        self.inputs = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)  # [3, T_max]
        self.input_ids, self.positions, self.kv_write_rows = self.inputs.unbind(0)  # [T_max] each
        self.kv_write_rows.fill_(dummy_row)
        # Staging for the padded page table: the batch's kv_indices, then dummy rows.
        max_rows = max([max(self.batch_sizes) * max_kv_len]
                       + [b * self.tree_kv_len(q) for b, q in self.tree_shapes])
        self.kv_indices = torch.full((max_rows,), dummy_row, dtype=torch.int32, device=device)
        self.kv_indptr = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        # Padding requests' kv_indptr steps: q, 2q, ... past the batch's last entry.
        self._pad_steps = {q: q * torch.arange(1, max_requests + 1, dtype=torch.int32, device=device)
                           for q in set(self.q_lens) | {q for _, q in self.tree_shapes}}
        # Tree masks: a padding request sees its q dummy rows as its prefix.
        self.tree_prefix_len = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.tree_lo = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.tree_hi = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.pool = None

    def pad(self, items: Sequence[ForwardItem]) -> Sequence[ForwardItem]:
        """`items` padded to the shape of one of this runner's decode/verify graphs
        (pad_to_graph), or unchanged."""
        return pad_to_graph(items, self.q_lens, max(self.batch_sizes), self.dummy_row, self.max_kv_len)

    def tree_kv_len(self, q: int) -> int:
        """Most kv rows one request of a tree graph with q branches attends to."""
        return self.max_kv_len + q * self.tree_local_rows

    def _static_batch(self, b: int, q: int, tree: bool) -> ForwardBatch:
        n = b * q
        qo = np.arange(0, (b + 1) * q, q, dtype=np.int32)
        mask = None
        if tree:
            zeros = np.zeros(n, dtype=np.int32)
            mask = TreeMask(prefix_len=self.tree_prefix_len[:b], lo=self.tree_lo[:n], hi=self.tree_hi[:n],
                            prefix_len_cpu=np.full(b, q, dtype=np.int32), lo_cpu=zeros, hi_cpu=zeros,
                            advance=self.tree_lo[:n], advance_cpu=zeros)  # advance: unused by a replay
        return ForwardBatch(
            input_ids=self.input_ids[:n], positions=self.positions[:n], kv_write_rows=self.kv_write_rows[:n],
            qo_indptr=torch.from_numpy(qo).to(self.device), kv_indptr=self.kv_indptr[: b + 1],
            kv_indices=self.kv_indices[:n], logits_indices=torch.arange(n, device=self.device),
            qo_indptr_cpu=qo, kv_indptr_cpu=qo.copy(), max_q_len=q, tree=mask,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, q_len), largest first, sharing one memory pool."""
        shapes = [(b, q, False) for b in reversed(self.batch_sizes) for q in reversed(self.q_lens)]
        shapes += [(b, q, True) for b, q in self.tree_shapes]
        shapes.sort(key=lambda s: -s[0] * s[1])
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b, q, tree in tqdm(shapes, desc="capturing CUDA graphs", unit="graph", leave=False):
            kv_len = self.tree_kv_len(q) if tree else self.max_kv_len
            attn = self.backend.make_graph_attention(b, q, b * kv_len, tree=tree)
            batch = self._static_batch(b, q, tree)
            # Each padding-only request attends to q dummy rows (kv_len = q_len).
            self.kv_write_rows[: b * q].fill_(self.dummy_row)
            self.kv_indices[: b * q].fill_(self.dummy_row)
            self.kv_indptr[: b + 1].copy_(torch.from_numpy(batch.kv_indptr_cpu))
            if tree:
                self.tree_prefix_len[:b].fill_(q)
                self.tree_lo[: b * q].zero_()
                self.tree_hi[: b * q].zero_()
            self.backend.begin_graph(attn, batch.kv_indptr_cpu, self.kv_indices[: b * q], batch, b * q)
            # Warm up on a side stream (torch.compile and cuBLAS pick their kernels
            # and workspaces here, not during capture).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._forward(batch)
            self.graphs[(b, q, tree)] = _Graph(b, q, tree, graph, attn, batch, out)
        torch.cuda.synchronize(self.device)  # sync: capture is start-up work, done once
        logger.info("captured %d CUDA graphs: batch sizes %s x q_len %s, tree shapes %s",
                    len(self.graphs), self.batch_sizes, self.q_lens, list(self.tree_shapes))

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.forward_fn(batch.input_ids, batch.positions, batch)  # [T, H]
        return hidden if self.logits_fn is None else self.logits_fn(hidden)  # [T, V]

    def graph_for(self, batch: ForwardBatch) -> _Graph | None:
        """The graph that can run `batch` (padded), or None."""
        q = batch.max_q_len
        r = batch.num_requests
        if batch.input_ids.shape[0] != r * q:  # ragged q_len
            return None
        tree = batch.tree is not None
        if tree:
            b = next((s for s, sq in self.tree_shapes if sq == q and s >= r), None)
            kv_len = self.tree_kv_len(q)
        else:
            b = next((s for s in self.batch_sizes if s >= r), None) if q in self.q_lens else None
            kv_len = self.max_kv_len
        if b is None or (b, q, tree) not in self.graphs:
            return None
        if int(np.diff(batch.kv_indptr_cpu).max()) > kv_len:
            return None
        return self.graphs[(b, q, tree)]

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Replay the graph for `batch`: final hidden [T, H] (or logits [T, V] with a
        logits_fn) of its tokens, or None if none fits. The result is a view of the
        graph's output buffer, valid until the next replay of that graph."""
        g = self.load(batch)
        return None if g is None else self.replay(g, batch)

    def replay(self, g: _Graph, batch: ForwardBatch) -> torch.Tensor:
        """Replay `g`, loaded with `batch`: `run`'s result."""
        g.graph.replay()
        return g.out[: batch.num_requests * g.q_len]

    def load(self, batch: ForwardBatch) -> _Graph | None:
        """Copy `batch` into the static inputs of the graph that fits it and plan its attention,
        or None if none fits. Its replay (`replay`) reads them: no other batch may be loaded
        in between, and token ids written into `input_ids` meanwhile are the ones it runs."""
        g = self.graph_for(batch)
        if g is None:
            return None
        r, q, b = batch.num_requests, g.q_len, g.batch_size
        n, n_pad = r * q, b * q
        ids = batch.input_ids
        if (batch.positions.data_ptr() == ids.data_ptr() + 8 * n
                and batch.kv_write_rows.data_ptr() == ids.data_ptr() + 16 * n):
            self.inputs[:, :n].copy_(ids.as_strided((3, n), (n, 1)))  # the three rows in one copy
        else:
            self.input_ids[:n].copy_(ids)
            self.positions[:n].copy_(batch.positions)
            self.kv_write_rows[:n].copy_(batch.kv_write_rows)
        if n_pad > n:
            # Earlier, larger batches left live rows here: padding must write the dummy row.
            self.kv_write_rows[n:n_pad].fill_(self.dummy_row)
        nnz = int(batch.kv_indptr_cpu[-1])
        nnz_pad = nnz + q * (b - r)
        self.kv_indices[:nnz].copy_(batch.kv_indices)
        # kv_indptr on the device: the batch's own, then the padding requests' steps.
        self.kv_indptr[: r + 1].copy_(batch.kv_indptr)
        if b > r:
            self.kv_indices[nnz:nnz_pad].fill_(self.dummy_row)
            torch.add(self._pad_steps[q][: b - r], nnz, out=self.kv_indptr[r + 1 : b + 1])
        if g.tree:
            tr = batch.tree
            self.tree_prefix_len[:r].copy_(tr.prefix_len)
            self.tree_lo[:n].copy_(tr.lo)
            self.tree_hi[:n].copy_(tr.hi)
            if b > r:
                self.tree_prefix_len[r:b].fill_(q)
                self.tree_lo[n:n_pad].zero_()
                self.tree_hi[n:n_pad].zero_()
        if not g.attn.host_plan:  # Triton: nothing to plan
            self.backend.begin_graph(g.attn, None, None, g.batch, nnz_pad)
        else:  # flashinfer plans on the host from the padded indptr
            kv_indptr = np.empty(b + 1, dtype=np.int64)
            kv_indptr[: r + 1] = batch.kv_indptr_cpu
            kv_indptr[r + 1:] = nnz + q * np.arange(1, b - r + 1)
            self.backend.begin_graph(g.attn, kv_indptr, self.kv_indices[:nnz_pad], g.batch, nnz_pad)
        return g
