"""Start-up defaults of --max-model-len and --max-num-seqs, from the model and the KV pools.

vLLM's defaults, where the pools allow them:
- max_model_len unset: the target's max_position_embeddings (the draft's, if smaller),
  cut to what the target's KV pool holds, so one full sequence always fits;
- max_num_seqs unset: 256 on CUDA, at most the target's KV blocks (each running sequence
  holds one at least); 8 on the CPU, whose pool is sized for those sequences.
The draft pages its KV the same way; it holds max_num_seqs sequences (draft_proc.factory).
Each choice is logged once at INFO with what bound it. Host code.
"""

from __future__ import annotations

import json
import logging
import os

from spec_runtime.config import MIN_MODEL_LEN

logger = logging.getLogger(__name__)

# The CPU pool holds max_num_seqs sequences of at most this many tokens (and one of
# max_model_len): with preemption longer ones still run, and the pool stays small.
CPU_ROWS_PER_SEQ = 2048


def cpu_pool_rows(max_num_seqs: int, max_model_len: int) -> int:
    """KV rows of the target's pool on the CPU when --num-kv-blocks is not given."""
    return max(max_num_seqs * min(max_model_len, CPU_ROWS_PER_SEQ), max_model_len)


def pool_model_len(pool_tokens: int, max_model_len: int, auto: bool, arch) -> int:
    """The context length a pool of pool_tokens allows. auto (--max-model-len unset):
    max_model_len cut to the pool, logged; given: kept, and longer requests are refused."""
    if pool_tokens < MIN_MODEL_LEN:
        raise ValueError(f"the target's KV pool holds {pool_tokens} tokens, fewer than the shortest context "
                         f"({MIN_MODEL_LEN}): raise --num-kv-blocks or --gpu-memory-utilization")
    if not auto:
        if pool_tokens < max_model_len:
            logger.warning("the KV pool holds %d tokens, fewer than max_model_len %d: longer requests are refused",
                           pool_tokens, max_model_len)
        return max_model_len
    if pool_tokens < max_model_len:
        logger.info("max_model_len %d: what the target's KV pool holds (the model allows %d)",
                    pool_tokens, max_model_len)
        return pool_tokens
    why = ("the model's max_position_embeddings" if max_model_len == arch.max_position_embeddings
           else "the draft's max_position_embeddings, below the target's")
    logger.info("max_model_len %d: %s", max_model_len, why)
    return max_model_len


def resolve_max_num_seqs(given: int, requested: int, num_blocks: int, step_cap: int = 0) -> int:
    """--max-num-seqs: as given, else `requested` (its device default) capped by the target's
    blocks and by step_cap (the sequences whose verifies fit one chunked-prefill step; 0: none)."""
    if given:
        return given
    caps = [(num_blocks, "the target's KV blocks")]
    if step_cap:
        caps.append((step_cap, "--max-num-batched-tokens / (K + 1)"))
    cap, why = min(caps)
    if cap < requested:
        logger.info("max_num_seqs %d: %s (default %d)", cap, why, requested)
        return max(1, cap)
    logger.info("max_num_seqs %d: the default", requested)
    return requested


def model_context_limit(path: str) -> int:
    """A model's max_position_embeddings read from its config without loading it: a
    Hugging Face directory or a random: benchmark model; 0 where that needs a load (.gguf)."""
    if path.startswith("random:"):
        from spec_runtime.bench.random_models import BENCH_ARCHS

        arch = BENCH_ARCHS.get(path.removeprefix("random:"))
        return arch.max_position_embeddings if arch is not None else 0
    config = os.path.join(path, "config.json")
    if path and os.path.isfile(config):
        with open(config) as f:
            return int(json.load(f).get("max_position_embeddings", 0) or 0)
    return 0
