"""The building blocks of a decoder: linear (replicated, column- and row-parallel),
RMSNorm, rotary embedding, SiLU-and-mul, vocabulary embedding and LM head.

Each layer holds its model's `KernelPlan` (kernels/plan.py) and picks its kernel from
it: the eager torch op on CPU (and wherever the plan says so), the fused CUDA kernel
otherwise. Model families (spec_runtime/models/) are written once against these layers.
"""
