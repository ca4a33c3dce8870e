"""The building blocks of a decoder: linear (replicated, column- and row-parallel),
RMSNorm, rotary embedding, SiLU-and-mul, vocabulary embedding and LM head.

Each layer holds its model's `KernelPlan` (kernels/plan.py) and picks its kernel from
it: the eager torch op on CPU (and wherever the plan says so), the fused CUDA kernel
otherwise. On the CPU the linear layers and the LM head can run over oneDNN-packed
weights (`pack_for_cpu`, which the runner calls when `KernelConfig.cpu_linear` says
so). Model families (spec_runtime/models/) are written once against these layers.
"""
