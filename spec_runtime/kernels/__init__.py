"""The CUDA kernels of the forward and the state that chooses among them.

`plan.KernelPlan` holds one model's choices (fused small ops, the one-token Triton
projections and their block sizes), made at start-up from the frozen `KernelConfig`;
`paged` holds the Triton paged attention and the fused RoPE + KV write; `small_linear`
the one-token projection kernel; `tuning` the start-up step that times it. Why each
kernel exists, and what it is measured against: docs/kernels.md.
"""
