"""ModelRunner: one model, its tokenizer, its KV pool and an attention backend.

Both processes use it the same way: describe the requests of a step as
ForwardItems (or a prebuilt ForwardBatch) and get float32 logits back. It knows
nothing about speculation; prefill, decode, verify and tree steps differ only in
the items they pass.

`ModelRunner.build` is the way to make one: it constructs the runner (load, attention
backend, KV sizing), then runs the two CUDA start-up steps in order, settling the
kernels (`tune_kernels`) and capturing CUDA graphs (`capture_graphs`), which bake the
kernel choices in. On CPU both steps do nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from spec_runtime.attention import make_backend
from spec_runtime.config import KernelConfig, ModelConfig
from spec_runtime.engine.forward_batch import ForwardBatch, ForwardItem, PagedLayout, SlotLayout, build_forward_batch
from spec_runtime.engine.kv_cache import KVCache
from spec_runtime.engine.sizing import cpu_pool_rows, pool_model_len
from spec_runtime.layers.linear import onednn_linear_available, pack_for_cpu
from spec_runtime.models.loader import eos_token_ids, load_model, model_name, resolve_dtype

logger = logging.getLogger(__name__)


def _kernel_config(kernels: KernelConfig | None, tp_size: int) -> KernelConfig:
    kernels = kernels or KernelConfig()
    if tp_size > 1 and kernels.small_linear != "off":
        # The one-token projection kernel folds the residual add into a whole-row
        # product; split rows need the all-reduce in between.
        kernels = dataclasses.replace(kernels, small_linear="off")
    return kernels


def _check_pool_args(num_slots: int, max_model_len: int, num_scratch_rows: int, block_size: int, num_blocks: int,
                     max_batch_size: int | None) -> None:
    if block_size < 0 or num_blocks < 0:
        raise ValueError(f"block_size and num_blocks must be >= 0, got {block_size} and {num_blocks}")
    if num_slots < 1 and block_size < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if block_size and not max_batch_size:
        raise ValueError("a paged KV pool needs max_batch_size (the most sequences of one forward)")
    if max_model_len < 0:
        raise ValueError(f"max_model_len must be >= 1 (or 0: the model's own limit), got {max_model_len}")
    if num_scratch_rows < 0:
        raise ValueError(f"num_scratch_rows must be >= 0, got {num_scratch_rows}")


def _device(name: str) -> torch.device:
    """The device `name` names, made the current CUDA device (flashinfer and CUDA graphs
    launch on the current one); bare "cuda" is the current one."""
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


class ModelRunner:
    """Runs forwards of one model over a KV pool.

    Slot layout (num_slots > 0): `num_slots` sequences of `max_model_len` rows each
    (capped by the model's max_position_embeddings), then `num_scratch_rows` rows for
    SSD branches. Paged layout (block_size > 0): blocks of block_size rows that the
    caller hands out (engine/kv_blocks.py), then `num_scratch_rows` rows.
    """

    def __init__(self, cfg: ModelConfig, *, num_slots: int = 0, max_model_len: int, num_scratch_rows: int = 0,
                 block_size: int = 0, num_blocks: int = 0,
                 max_batch_size: int | None = None, graph_q_lens: Sequence[int] = (1,),
                 tree_shapes: Sequence[tuple[int, int]] = (), tree_local_rows: int = 0,
                 kernels: KernelConfig | None = None, tp=None, context_limit: int = 0) -> None:
        """On CUDA, `num_slots` is a cap (the pool gets what fits in gpu_memory_utilization;
        read `layout.num_slots`), and CUDA graphs are captured for up to `max_batch_size`
        requests (default num_slots) of each q_len in `graph_q_lens` (1 = decode, K+1 = verify),
        and for each SSD tree step shape (sequences, branches) in `tree_shapes`, whose
        branches see at most `tree_local_rows` rows beyond their sequence's prefix.
        block_size > 0 lays the pool out in blocks instead of slots: `num_blocks` of them
        (on CUDA, 0 takes what fits in gpu_memory_utilization; on CPU, 0 takes enough for
        max_batch_size sequences of max_model_len rows); read `layout.num_blocks`.
        max_model_len 0: the model's max_position_embeddings (or `context_limit`, another
        model's, if smaller), and in a paged pool at most what the pool holds; read
        `layout.max_model_len`.
        kernels: the CUDA kernel choices (default KernelConfig()). tp: this process's
        engine.parallel.TPGroup when the model is split over several (every rank builds
        its runner with the same arguments; rank 0's `run` leads the others'). Use
        `build`, which also tunes the kernels and captures the graphs."""
        _check_pool_args(num_slots, max_model_len, num_scratch_rows, block_size, num_blocks, max_batch_size)
        self.cfg = cfg
        self.tp = tp
        tp_size, tp_rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        self.kernel_cfg = _kernel_config(kernels, tp_size)
        self.device = _device(cfg.device if tp is None else str(tp.device))
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        # Seconds per start-up phase (load, kv_alloc, graph_capture with kernel tuning), sent in Ready.
        self.startup_phases: dict[str, float] = {}
        self._load(tp_size, tp_rank)
        t0 = time.perf_counter()
        self.auto_model_len = not max_model_len
        max_model_len = self._context_len(max_model_len, context_limit)
        num_heads, num_kv_heads = self.arch.num_heads // tp_size, self.arch.num_kv_heads // tp_size  # this rank's
        self.backend = make_backend(num_heads, num_kv_heads, self.arch.head_dim, self.dtype,
                                    self.device, sliding_window=self.arch.sliding_window,
                                    graph_attention=self.kernel_cfg.attention_backend)
        t_backend = time.perf_counter()
        max_batch_size = max_batch_size or num_slots
        if block_size:
            self.layout = self._paged_layout(block_size, num_blocks, max_model_len, max_batch_size, graph_q_lens,
                                             tree_shapes, num_scratch_rows)
        else:
            self.layout = self._slot_layout(num_slots, max_model_len, max_batch_size, graph_q_lens, tree_shapes,
                                            num_scratch_rows)
        # One row past the layout that no sequence owns, for padded requests and branches.
        self.dummy_row = self.layout.num_rows
        self.kv_cache = KVCache(self.arch.num_layers, self.layout.num_rows + 1, num_kv_heads,
                                self.arch.head_dim, self.dtype, self.device)
        self.model.bind(self.backend, self.kv_cache)
        self.startup_phases["kv_alloc_s"] = time.perf_counter() - t0
        # Its parts, for the start-up log line only: the attention backend (on CUDA its
        # kernel libraries load), then the pool's sizing (a warm-up forward) and allocation.
        self.kv_alloc_parts = {"backend": t_backend - t0, "sizing and allocation": time.perf_counter() - t_backend}
        self.startup_phases["graph_capture_s"] = 0.0  # build: kernel tuning and graph capture
        self.graphs = None
        self.kernel_report: dict = {}  # what tune_kernels decided and measured
        self._graph_args = dict(max_batch_size=max_batch_size, q_lens=graph_q_lens,
                                tree_shapes=tree_shapes, tree_local_rows=tree_local_rows)

    def _load(self, tp_size: int, tp_rank: int) -> None:
        """The model (this rank's shard), its tokenizer, name, vocabulary and EOS ids."""
        cfg, t0 = self.cfg, time.perf_counter()
        self.model, self.arch, self.tokenizer = load_model(cfg.path, self.device, self.dtype, cfg.gguf_cache,
                                                           tp_size=tp_size, tp_rank=tp_rank)
        self.model_name = model_name(cfg.path)
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = eos_token_ids(cfg.path, self.arch, self.tokenizer, cfg.gguf_cache)
        # The layers run the fused CUDA kernels where the config allows; eager ops on CPU,
        # with the projections over oneDNN-packed weights where it can.
        self.model.kernels.fused = self.device.type == "cuda" and self.kernel_cfg.fused_ops
        self._pack_cpu_weights()
        self.startup_phases["load_s"] = time.perf_counter() - t0

    def _pack_cpu_weights(self) -> None:
        if self.device.type != "cpu" or self.kernel_cfg.cpu_linear != "onednn":
            return
        if self.dtype != torch.float32 or not onednn_linear_available():
            logger.info("%s: projections through F.linear (oneDNN packing needs float32 and a torch build with "
                        "oneDNN; dtype %s)", self.model_name, self.dtype)
            return
        t0 = time.perf_counter()  # part of load_s
        n = pack_for_cpu(self.model)
        logger.info("%s: %d weights packed for oneDNN in %.2f s", self.model_name, n, time.perf_counter() - t0)

    def _context_len(self, max_model_len: int, context_limit: int) -> int:
        """max_model_len as asked, capped by the model; 0: the model's own limit (and
        context_limit's, if smaller)."""
        limit = self.arch.max_position_embeddings
        if not max_model_len:
            return min(limit, context_limit) if context_limit else limit
        if max_model_len > limit:
            logger.warning("max_model_len %d capped to the model's max_position_embeddings %d", max_model_len, limit)
        return min(max_model_len, limit)

    def _slot_layout(self, num_slots: int, max_model_len: int, max_batch_size: int, graph_q_lens: Sequence[int],
                     tree_shapes: Sequence[tuple[int, int]], num_scratch_rows: int) -> SlotLayout:
        """A pool of num_slots contexts (on CUDA, at most what fits); then num_scratch_rows rows."""
        if self.device.type == "cuda":
            num_slots = self._fit(num_slots, max_model_len, max_batch_size, graph_q_lens, tree_shapes,
                                  num_scratch_rows=num_scratch_rows)
        if self.tp is not None:
            num_slots = self.tp.min_int(num_slots)  # every rank's pool holds the same rows
        return SlotLayout(num_slots, max_model_len, num_scratch_rows)

    def _paged_layout(self, block_size: int, num_blocks: int, max_model_len: int, max_batch_size: int,
                      graph_q_lens: Sequence[int], tree_shapes: Sequence[tuple[int, int]] = (),
                      num_scratch_rows: int = 0) -> PagedLayout:
        """The block pool: num_blocks if given (on CUDA, at most what fits), else what
        fits (CUDA) or max_batch_size contexts (CPU); then num_scratch_rows rows."""
        if self.device.type == "cuda":
            fit = self._fit(0, max_model_len, max_batch_size, graph_q_lens, tree_shapes, block_size=block_size,
                            num_scratch_rows=num_scratch_rows)
            if num_blocks > fit:
                logger.warning("only %d of %d KV blocks fit in gpu_memory_utilization=%.2f",
                               fit, num_blocks, self.cfg.gpu_memory_utilization)
            num_blocks = min(num_blocks, fit) if num_blocks else fit
        elif not num_blocks:
            num_blocks = -(-cpu_pool_rows(max_batch_size, max_model_len) // block_size)
        if self.tp is not None:
            num_blocks = self.tp.min_int(num_blocks)  # every rank's pool holds the same rows
        model_len = pool_model_len(num_blocks * block_size, max_model_len, self.auto_model_len, self.arch)
        return PagedLayout(num_blocks, block_size, model_len, num_scratch_rows)

    def _fit(self, num_slots: int, max_model_len: int, max_batch_size: int, graph_q_lens: Sequence[int],
             tree_shapes: Sequence[tuple[int, int]], *, num_scratch_rows: int = 0, block_size: int = 0) -> int:
        """CUDA: the slots (at most num_slots) or blocks (block_size > 0) that fit in
        gpu_memory_utilization beside the weights, a warm-up forward and the graphs'
        logits buffers (engine/memory.py)."""
        from spec_runtime.engine.cuda_graphs import graph_logits_bytes
        from spec_runtime.engine.memory import fit_num_blocks, fit_num_slots

        cfg = self.cfg
        logits_bytes = (graph_logits_bytes(max_batch_size, graph_q_lens, self.vocab_size, tree_shapes)
                        if cfg.cuda_graphs else 0)
        common = dict(gpu_memory_utilization=cfg.gpu_memory_utilization, max_model_len=max_model_len,
                      warmup_tokens=max_model_len, reserve_bytes=logits_bytes)
        if block_size:
            return fit_num_blocks(self.model, self.backend, block_size=block_size, num_scratch_rows=num_scratch_rows,
                                  **common)
        return fit_num_slots(self.model, self.backend, num_slots=num_slots, num_scratch_rows=num_scratch_rows,
                             **common)

    @classmethod
    def build(cls, cfg: ModelConfig, *, kernels: KernelConfig | None = None, **kw) -> "ModelRunner":
        """A ready runner: constructed, its kernels settled, its CUDA graphs captured."""
        runner = cls(cfg, kernels=kernels, **kw)
        t0 = time.perf_counter()
        runner.tune_kernels()
        runner.capture_graphs()
        runner.startup_phases["graph_capture_s"] = time.perf_counter() - t0
        runner.warm_attention_kernels()
        logger.info("%s: %s, layout %s; start-up %s (kv_alloc: %s)", runner.model_name, runner.kv_cache, runner.layout,
                    ", ".join(f"{k} {v:.2f}" for k, v in runner.startup_phases.items()),
                    ", ".join(f"{k} {v:.2f} s" for k, v in runner.kv_alloc_parts.items()))
        return runner

    def tune_kernels(self) -> dict:
        """CUDA: settle the one-token projections (kernels/tuning.py) before graphs are
        captured; the result is kept in `kernel_report` and logged. CPU: nothing."""
        if self.device.type != "cuda":
            return {}
        from spec_runtime.kernels.tuning import plan_one_token

        self.kernel_report = plan_one_token(self.model, self.kernel_cfg)
        return self.kernel_report

    def warm_attention_kernels(self) -> None:
        """CUDA: compile the attention kernels' variants now, not in the first step that
        meets one (CudaAttentionBackend.warm_up); the time is a start-up phase."""
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            self.backend.warm_up(trees=bool(self._graph_args["tree_shapes"]))
            self.startup_phases["attention_kernels_s"] = time.perf_counter() - t0

    def warm_sampling_kernels(self, top_k_q: int) -> None:
        """CUDA: compile the sampling kernels now, not in the first step that needs one
        (spec_runtime.sampling.warm_up_kernels); the time is a start-up phase."""
        if self.device.type == "cuda":
            from spec_runtime.sampling import warm_up_kernels

            self.startup_phases["sampling_kernels_s"] = warm_up_kernels(self.device, self.vocab_size, top_k_q)

    def capture_graphs(self) -> None:
        """CUDA with cuda_graphs on: capture the decode, verify and tree-step graphs."""
        if self.device.type != "cuda" or not self.cfg.cuda_graphs or self.graphs is not None:
            return
        from spec_runtime.engine.cuda_graphs import CudaGraphRunner

        args = self._graph_args
        # No graph for a tree shape the attention cannot run: the SSD engine uses
        # its per-branch layout there.
        tree_shapes = [(b, q) for b, q in args["tree_shapes"] if self.backend.supports_tree(q)]
        self.graphs = CudaGraphRunner(
            self.model, self.backend, max_batch_size=args["max_batch_size"], q_lens=args["q_lens"],
            max_kv_len=self.layout.max_model_len, dummy_row=self.dummy_row, device=self.device,
            logits_fn=self.model.compute_logits, tree_shapes=tree_shapes, tree_local_rows=args["tree_local_rows"])
        self.graphs.capture()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] float32 of the rows batch.logits_indices selects; with `rows`
        (device indices into those N), of those rows only, in one gather."""
        if self.device.type == "cuda":
            logits = self.graphs.run(batch) if self.graphs is not None else None  # [T, V]; None: no graph fits
            if logits is not None:
                return _rows_of(batch, logits, rows)
        self.backend.begin(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, H]
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, V]
        return logits if rows is None else logits[rows]

    def run(self, items: Sequence[ForwardItem], fill=None) -> torch.Tensor:
        """Logits of `items` (padded to a graph's shape where one fits, see `_batch`);
        positions must fit in max_model_len. With
        tensor parallelism, rank 0 sends the items to the other ranks first (they run
        the same forward in `follow`). fill(input_ids): writes token ids that are still on
        the device into the batch's input ids before the forward (target_proc/ahead.py);
        not with tensor parallelism, whose other ranks take the ids from the host."""
        limit = self.layout.max_model_len
        for it in items:
            if it.start_pos + len(it.token_ids) > limit:
                raise ValueError(
                    f"request reaches position {it.start_pos + len(it.token_ids)} > max_model_len {limit}"
                )
        if self.tp is not None:
            if fill is not None:
                raise ValueError("tensor-parallel ranks take their input ids from the host: no fill")
            self.tp.send_items(items)
        batch = self._batch(items)
        if fill is not None:
            fill(batch.input_ids)
        return self.forward(batch)

    def prepare(self, items: Sequence[ForwardItem], eager: bool = False) -> "Prepared | None":
        """`run(items)` laid out ahead: its batch built, and loaded into its CUDA graph, but not
        run. Token ids may still be written into `Prepared.input_ids` (flat indices
        `Prepared.token_index(i, j)`: item i's token j); `run_prepared` runs it. Nothing else may
        run on this runner in between (a graph's static inputs hold the batch). None with tensor
        parallelism (the other ranks take their ids from the host) and, unless `eager` (then it
        runs without a graph), where no captured graph fits: checked before the batch is built
        where the runner has none (the CPU; `can_prepare`)."""
        if not self.can_prepare(eager):
            return None
        graphs = self.graphs if self.device.type == "cuda" else None
        limit = self.layout.max_model_len
        if any(it.start_pos + len(it.token_ids) > limit for it in items):
            return None  # run() says why
        batch = self._batch(items)
        g = graphs.load(batch) if graphs is not None else None
        if g is None and not eager:
            return None
        return Prepared(batch, g, graphs.input_ids if g is not None else batch.input_ids,
                        g.q_len if g is not None else 0)

    def can_prepare(self, eager: bool = False) -> bool:
        """Whether `prepare` may lay a forward out at all: not with tensor parallelism, and
        without `eager` only on a runner with CUDA graphs (a batch may still fit none)."""
        return self.tp is None and (eager or (self.device.type == "cuda" and self.graphs is not None))

    def run_prepared(self, prep: "Prepared") -> torch.Tensor:
        """Logits of a `prepare`d forward, as `run` returns them."""
        if prep.graph is not None:
            return _rows_of(prep.batch, self.graphs.replay(prep.graph, prep.batch), None)
        return self.forward(prep.batch)

    def _batch(self, items: Sequence[ForwardItem]) -> ForwardBatch:
        """The batch of `items`, padded to a captured graph's shape where one fits: callers
        pass their real lengths and get the logits of their own rows back."""
        if self.graphs is not None:
            items = self.graphs.pad(items)
        return build_forward_batch(items, self.device)

    def follow(self) -> None:
        """Tensor-parallel ranks 1..N-1: run rank 0's forwards until it stops the group
        (padded as rank 0 pads them, so the collectives see the same shapes)."""
        while (items := self.tp.recv_items()) is not None:
            self.forward(self._batch(items))


@dataclasses.dataclass
class Prepared:
    """A forward laid out by ModelRunner.prepare: its batch, and the graph loaded with it (or None: run eagerly)."""

    batch: ForwardBatch
    graph: object  # cuda_graphs._Graph or None
    input_ids: torch.Tensor  # the token ids the forward reads (the graph's static buffer, or the batch's)
    q_len: int  # the graph's tokens per request (items are padded to it), 0 without a graph

    def token_index(self, item: int, token: int) -> int:
        """The flat index in input_ids of item `item`'s token `token`."""
        start = item * self.q_len if self.graph is not None else int(self.batch.qo_indptr_cpu[item])
        return start + token


def _rows_of(batch: ForwardBatch, logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The logits rows `batch` asks for out of a graph's output [T, V], as ModelRunner.forward returns them."""
    # The graph's buffer is overwritten by its next replay: hand out a copy.
    # logits_indices are ascending and unique, so N == T means every row.
    idx = batch.logits_indices
    if idx.shape[0] == logits.shape[0]:
        return logits.clone() if rows is None else logits[rows]  # [N, V]
    return logits[idx] if rows is None else logits[idx[rows]]
