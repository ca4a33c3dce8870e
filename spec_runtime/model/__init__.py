"""Model execution shared by target_proc and draft_proc: Llama-family models over a KV pool.

Every forward is a `ForwardBatch` (forward_batch.py): ragged requests over explicit KV
rows with causal bottom-right attention. `ModelRunner` is the entry point; the model
(llama.py) calls attention through an `AttentionBackend` (attention.py) so the CPU SDPA
and CUDA backends share all other code. Nothing here knows about speculation.
"""

from spec_runtime.model.attention import AttentionBackend, SDPABackend
from spec_runtime.model.forward_batch import ForwardBatch, ForwardItem, SlotLayout, build_forward_batch
from spec_runtime.model.hf_config import ModelArch, arch_from_config, load_arch
from spec_runtime.model.kv_cache import KVCache, kv_bytes_per_token
from spec_runtime.model.loader import default_model_path, load_model, load_tokenizer, resolve_dtype
from spec_runtime.model.runner import ModelRunner

__all__ = [
    "AttentionBackend", "SDPABackend", "ForwardBatch", "ForwardItem", "SlotLayout", "build_forward_batch",
    "ModelArch", "arch_from_config", "load_arch", "KVCache", "kv_bytes_per_token",
    "default_model_path", "load_model", "load_tokenizer", "resolve_dtype", "ModelRunner",
]
