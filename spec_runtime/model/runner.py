"""ModelRunner: one model, its tokenizer, its KV pool and an attention backend.

Both processes use it the same way: describe the requests of a step as
ForwardItems (or a prebuilt ForwardBatch) and get float32 logits back. It knows
nothing about speculation; prefill, decode, verify and tree steps differ only in
the items they pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from spec_runtime.config import ModelConfig
from spec_runtime.model.attention import AttentionBackend, SDPABackend
from spec_runtime.model.forward_batch import ForwardBatch, ForwardItem, SlotLayout, build_forward_batch
from spec_runtime.model.kv_cache import KVCache
from spec_runtime.model.loader import eos_token_ids, load_model, model_name, resolve_dtype

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs forwards of one model over a slot-laid-out KV pool.

    The pool has `num_slots` sequences of `max_model_len` rows each (capped by the
    model's max_position_embeddings), then `num_scratch_rows` rows for SSD branches.
    """

    def __init__(self, cfg: ModelConfig, *, num_slots: int, max_model_len: int, num_scratch_rows: int = 0,
                 max_batch_size: int | None = None, graph_q_lens: Sequence[int] = (1,),
                 tree_shapes: Sequence[tuple[int, int]] = (), tree_local_rows: int = 0) -> None:
        """On CUDA, `num_slots` is a cap (the pool gets what fits in gpu_memory_utilization;
        read `layout.num_slots`), and CUDA graphs are captured for up to `max_batch_size`
        requests (default num_slots) of each q_len in `graph_q_lens` (1 = decode, K+1 = verify),
        and for each SSD tree step shape (sequences, branches) in `tree_shapes`, whose
        branches see at most `tree_local_rows` rows beyond their sequence's prefix."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if num_scratch_rows < 0:
            raise ValueError(f"num_scratch_rows must be >= 0, got {num_scratch_rows}")
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # "cuda" = the current one
        if self.device.type == "cuda":
            # flashinfer and CUDA graphs launch on the current device: make it this one.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        # Seconds per start-up phase (load, kv_alloc, graph_capture), sent in Ready.
        self.startup_phases: dict[str, float] = {}
        t0 = time.perf_counter()
        self.model, self.arch, self.tokenizer = load_model(cfg.path, self.device, self.dtype, cfg.gguf_cache)
        self.model_name = model_name(cfg.path)
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = eos_token_ids(cfg.path, self.arch, self.tokenizer, cfg.gguf_cache)
        self.startup_phases["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if max_model_len > self.arch.max_position_embeddings:
            logger.warning("max_model_len %d capped to the model's max_position_embeddings %d",
                           max_model_len, self.arch.max_position_embeddings)
            max_model_len = self.arch.max_position_embeddings
        self.backend = self._make_backend()
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            from spec_runtime.model.cuda_graphs import graph_logits_bytes
            from spec_runtime.model.cuda_memory import fit_num_slots

            logits_bytes = (graph_logits_bytes(max_batch_size or num_slots, graph_q_lens, self.vocab_size,
                                               tree_shapes) if cfg.cuda_graphs else 0)
            num_slots = fit_num_slots(self.model, self.backend, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                      num_slots=num_slots, max_model_len=max_model_len,
                                      num_scratch_rows=num_scratch_rows, warmup_tokens=max_model_len,
                                      reserve_bytes=logits_bytes)
        self.layout = SlotLayout(num_slots, max_model_len, num_scratch_rows)
        # One row past the layout that no sequence owns, for padded requests and branches.
        self.dummy_row = self.layout.num_rows
        self.kv_cache = KVCache(self.arch.num_layers, self.layout.num_rows + 1, self.arch.num_kv_heads,
                                self.arch.head_dim, self.dtype, self.device)
        self.model.bind(self.backend, self.kv_cache)
        self.startup_phases["kv_alloc_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.graphs = None
        if is_cuda:
            from spec_runtime.model.cuda_ops import fused_ops_enabled, pick_small_linear

            if fused_ops_enabled():
                pick_small_linear(self.model)  # before capture: the graphs bake the choice in
        if is_cuda and cfg.cuda_graphs:
            from spec_runtime.model.cuda_graphs import CudaGraphRunner

            # No graph for a tree shape the attention cannot run: the SSD engine uses
            # its per-branch layout there.
            tree_shapes = [(b, q) for b, q in tree_shapes if self.backend.supports_tree(q)]
            self.graphs = CudaGraphRunner(
                self._cuda_forward, self.backend, max_batch_size=max_batch_size or num_slots,
                q_lens=graph_q_lens, max_kv_len=max_model_len, dummy_row=self.dummy_row, device=self.device,
                logits_fn=self.model.compute_logits, tree_shapes=tree_shapes, tree_local_rows=tree_local_rows)
            self.graphs.capture()
        self.startup_phases["graph_capture_s"] = time.perf_counter() - t0
        logger.info("%s: %s, layout %s; start-up %s", self.model_name, self.kv_cache, self.layout,
                    ", ".join(f"{k} {v:.2f}" for k, v in self.startup_phases.items()))

    def _make_backend(self) -> AttentionBackend:
        """SDPA on CPU, flashinfer on CUDA."""
        if self.device.type == "cpu":
            return SDPABackend(self.arch.num_heads, self.arch.num_kv_heads, self.arch.head_dim)
        from spec_runtime.model.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(self.arch.num_heads, self.arch.num_kv_heads, self.arch.head_dim,
                                 self.dtype, self.device)

    def _cuda_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        from spec_runtime.model.cuda_ops import cuda_forward

        return cuda_forward(self.model, input_ids, positions, batch)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, V] float32 of the rows batch.logits_indices selects."""
        if self.device.type == "cuda":
            logits = self.graphs.run(batch) if self.graphs is not None else None  # [T, V]; None: no graph fits
            if logits is not None:
                # The graph's buffer is overwritten by its next replay: hand out a copy.
                # logits_indices are ascending and unique, so N == T means every row.
                idx = batch.logits_indices
                return logits.clone() if idx.shape[0] == logits.shape[0] else logits[idx]  # [N, V]
            self.backend.begin(batch)
            hidden = self._cuda_forward(batch.input_ids, batch.positions, batch)  # [T, H]
            return self.model.compute_logits(hidden[batch.logits_indices])  # [N, V]
        self.backend.begin(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, H]
        return self.model.compute_logits(hidden[batch.logits_indices])  # [N, V]

    def run(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """build_forward_batch + forward; positions must fit in max_model_len."""
        limit = self.layout.max_model_len
        for it in items:
            if it.start_pos + len(it.token_ids) > limit:
                raise ValueError(
                    f"request reaches position {it.start_pos + len(it.token_ids)} > max_model_len {limit}"
                )
        return self.forward(build_forward_batch(items, self.device))
