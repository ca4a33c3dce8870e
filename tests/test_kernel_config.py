"""KernelConfig: validated when built, reachable from the CLI flags, carried in the Init
message, and read into each model's KernelPlan by the runner (eager ops on CPU, with the
projections over oneDNN-packed weights unless cpu_linear is torch)."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from spec_runtime.cli_flags import ConfigErrors, add_config_flags, config_from_args
from spec_runtime.config import KernelConfig, ModelConfig, RuntimeConfig


def test_kernel_config_validates() -> None:
    with pytest.raises(ValueError, match="small_linear must be"):
        KernelConfig(small_linear="yes")
    with pytest.raises(ValueError, match="attention_backend must be"):
        KernelConfig(attention_backend="sdpa")
    with pytest.raises(ValueError, match="needs fused_ops"):
        KernelConfig(small_linear="on", fused_ops=False)
    with pytest.raises(ValueError, match="cpu_linear must be"):
        KernelConfig(cpu_linear="mkl")


def test_kernel_flags_build_the_config_and_travel_in_init() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_args(parser.parse_args(["--attention-backend", "flashinfer", "--small-linear", "off",
                                              "--no-tune-small-linear", "--cpu-linear", "torch"]))
    assert cfg.kernels == KernelConfig(attention_backend="flashinfer", small_linear="off", tune_small_linear=False,
                                       cpu_linear="torch")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=RuntimeConfig) == cfg
    with pytest.raises(ConfigErrors, match="--small-linear on needs fused_ops"):
        config_from_args(parser.parse_args(["--small-linear", "on", "--no-fused-ops"]))


def test_cpu_runner_runs_eager_whatever_the_config(tiny_qwen3_dir) -> None:
    from spec_runtime.engine.runner import ModelRunner

    runner = ModelRunner.build(ModelConfig(path=tiny_qwen3_dir), kernels=KernelConfig(small_linear="on"),
                               num_slots=1, max_model_len=32)
    plan = runner.model.kernels
    assert not plan.fused and not plan.small_linear and runner.graphs is None and runner.kernel_report == {}
    # Every layer reads the model's one plan.
    assert all(layer.input_layernorm.plan is plan and layer.mlp.gate_up_proj.plan is plan
               for layer in runner.model.layers)


def test_cpu_linear_packs_the_weights_and_keeps_the_logits(tiny_qwen3_dir) -> None:
    import numpy as np
    import torch

    from spec_runtime.engine.forward_batch import ForwardItem
    from spec_runtime.engine.runner import ModelRunner
    from spec_runtime.layers.linear import onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    runners = {c: ModelRunner.build(ModelConfig(path=tiny_qwen3_dir), kernels=KernelConfig(cpu_linear=c),
                                    num_slots=1, max_model_len=32) for c in ("onednn", "torch")}
    layer = runners["onednn"].model.layers[0]
    assert layer.self_attn.qkv_proj.packed_weight is not None and layer.self_attn.qkv_proj.weight is None
    plain = runners["torch"].model.layers[0].mlp.down_proj
    assert plain.packed_weight is None and plain.weight is not None
    item = ForwardItem(token_ids=[5, 9, 2, 7, 1], start_pos=0, kv_rows=np.arange(5), logits="all")
    logits = {c: r.run([item]) for c, r in runners.items()}
    torch.testing.assert_close(logits["onednn"], logits["torch"], atol=1e-4, rtol=1e-4)
