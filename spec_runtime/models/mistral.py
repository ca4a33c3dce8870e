"""Mistral: the Llama decoder with sliding-window attention.

Every layer attends to the `arch.sliding_window` most recent tokens (itself
included), as transformers' Mistral does. The window is a property of the attention,
so the layers are Llama's; the attention backend applies the window (the CPU SDPA
backend masks it; the CUDA backend refuses a windowed model).
"""

from __future__ import annotations

from spec_runtime.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers and weights; the backend is built with the model's window."""

    sliding_window_supported = True
