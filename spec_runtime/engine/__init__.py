"""Running a model over a KV pool, shared by target_proc and draft_proc.

Every forward is a `ForwardBatch` (forward_batch.py): ragged requests over explicit KV
rows with causal bottom-right attention. `ModelRunner` (runner.py) is the entry point:
it loads a model of a registered family (spec_runtime.models), sizes and owns the KV
pool (kv_cache.py, memory.py), binds an attention backend (spec_runtime.attention),
and on CUDA settles the kernels and captures graphs (cuda_graphs.py). Nothing here
knows about speculation. Modules are imported by their own paths (this package
imports nothing, so the attention backends can use forward_batch without a circle).
"""
