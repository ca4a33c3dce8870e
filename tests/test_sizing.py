"""--max-model-len and --max-num-seqs unset: sized from the model and the target's KV pool (CPU)."""

from __future__ import annotations

import argparse

import pytest
from conftest import save_tiny_model

from spec_runtime.cli_flags import add_config_flags, config_from_args
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from spec_runtime.engine.sizing import model_context_limit
from target_proc.model import resolved_config, target_runner

BS = 16


def _cfg(target: str, draft: str = "", mode: str = "ar", **sched) -> RuntimeConfig:
    return RuntimeConfig(target=ModelConfig(path=target), draft=ModelConfig(path=draft or "ngram"),
                         spec=SpeculativeConfig(mode=mode), sched=SchedulerConfig(block_size=BS, **sched))


@pytest.fixture(scope="module")
def target_512(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("t") / "target", "llama", max_position_embeddings=512)


def test_unset_flags_are_zero_and_vllm_names_set_them():
    assert SchedulerConfig().max_batch_size == 0 and SchedulerConfig().max_model_len == 0
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_args(parser.parse_args(["--max-num-seqs", "5", "--max-model-len", "64"]))
    assert (cfg.sched.max_batch_size, cfg.sched.max_model_len) == (5, 64)
    with pytest.raises(ValueError, match="max_model_len must be >= 16"):
        SchedulerConfig(max_model_len=8)


def test_defaults_come_from_the_models_config(target_512, caplog):
    caplog.set_level("INFO")
    cfg = _cfg(target_512)
    runner = target_runner(cfg)
    assert runner.layout.max_model_len == 512  # max_position_embeddings
    assert runner.max_num_seqs == 8  # the CPU default
    assert runner.layout.num_blocks * BS == 8 * 512  # the CPU pool: 8 sequences of min(512, 2048) tokens
    assert "max_model_len 512: the model's max_position_embeddings" in caplog.text
    assert "max_num_seqs 8: the default" in caplog.text
    sched = resolved_config(cfg, runner).sched
    assert (sched.max_batch_size, sched.max_model_len) == (8, 512)


def test_a_shorter_draft_limits_the_context(target_512, tmp_path):
    draft = save_tiny_model(tmp_path / "draft", "llama", max_position_embeddings=256)
    assert model_context_limit(draft) == 256 and model_context_limit("random:draft-1b") == 32768
    runner = target_runner(_cfg(target_512, draft, mode="sd"))
    assert runner.layout.max_model_len == 256


def test_explicit_flags_win(target_512):
    runner = target_runner(_cfg(target_512, max_model_len=128, max_batch_size=3, num_kv_blocks=4))
    # A pool shorter than an explicit max_model_len keeps it (longer requests are refused).
    assert (runner.layout.max_model_len, runner.max_num_seqs) == (128, 3)


def test_the_pool_caps_both_defaults(target_512, caplog):
    caplog.set_level("INFO")
    runner = target_runner(_cfg(target_512, num_kv_blocks=5))
    assert runner.layout.max_model_len == 5 * BS  # one full sequence fits the pool
    assert runner.max_num_seqs == 5  # each running sequence holds a block at least
    assert "what the target's KV pool holds" in caplog.text and "the target's KV blocks" in caplog.text


def test_a_pool_too_small_for_any_sequence_is_a_clear_error(target_512):
    with pytest.raises(ValueError, match="KV pool holds 8 tokens.*--num-kv-blocks or --gpu-memory-utilization"):
        target_runner(RuntimeConfig(target=ModelConfig(path=target_512), spec=SpeculativeConfig(mode="ar"),
                                    sched=SchedulerConfig(block_size=8, num_kv_blocks=1)))


def test_ready_reports_the_sized_values(target_512, tmp_path):
    from spec_runtime.launcher import Launcher

    draft = save_tiny_model(tmp_path / "draft", "llama", seed=1, max_position_embeddings=256)
    launcher = Launcher(_cfg(target_512, draft, mode="sd"))
    try:
        target, drafted = launcher.ready["target"], launcher.ready["draft"]
        assert (target.max_model_len, target.max_batch_size) == (256, 8)
        assert (drafted.max_model_len, drafted.max_batch_size) == (256, 8)  # the draft's own limit, 8 slots
    finally:
        launcher.shutdown()


def test_capacity_report_counts_full_length_sequences(target_512, tmp_path, capsys):
    import kv_capacity

    draft = save_tiny_model(tmp_path / "draft", "llama", seed=1)
    common = ["--target", target_512, "--draft", draft, "--device", "cpu", "--max-model-len", "256"]
    out = kv_capacity.main(common)
    # CPU: 8 sequences (the default) of 256 tokens in the target's pool, 8 draft slots.
    assert (out["target_full_seqs"], out["draft_slots"], out["before"], out["after"]) == (8, 8, 8, 8)
    out = kv_capacity.main([*common, "--num-kv-blocks", "400", "--max-num-seqs", "16"])
    assert out["target"]["max_num_seqs"] == 16 and out["draft_slots"] == 16
    # The slot model's 8 against 16 draft slots; the target's 400 blocks hold 25 full sequences.
    assert (out["target_full_seqs"], out["before"], out["after"]) == (25, 8, 16)
    assert "concurrent 256-token sequences: before 8" in capsys.readouterr().out


def test_fewer_draft_slots_than_target_sequences_are_warned(caplog):
    from protocol.messages import Ready
    from spec_runtime.launcher import _warn_few_draft_slots

    def ready(role, n, name):
        return Ready(protocol_version=1, role=role, pid=1, vocab_size=8, kv_capacity=0, max_batch_size=n,
                     max_model_len=64, model_name=name)

    _warn_few_draft_slots(ready("target", 256, "t"), ready("draft", 256, "d"))
    assert "decode without speculation" not in caplog.text
    _warn_few_draft_slots(ready("target", 256, "t"), ready("draft", 40, "d"))
    assert "the draft holds 40 sequences, the target runs up to 256" in caplog.text


def test_the_step_budget_caps_the_default(target_512, caplog):
    caplog.set_level("INFO")
    cfg = RuntimeConfig(target=ModelConfig(path=target_512), spec=SpeculativeConfig(mode="sd", k=4),
                        sched=SchedulerConfig(block_size=BS, max_num_batched_tokens=20))
    runner = target_runner(cfg)
    assert runner.max_num_seqs == 20 // 5  # every running sequence's verify (K + 1 tokens) fits one step
    assert "--max-num-batched-tokens / (K + 1)" in caplog.text
    resolved_config(cfg, runner)  # passes the step-budget check


def test_a_draft_on_the_targets_gpu_needs_shares_that_fit_together():
    from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
    from spec_runtime.launcher import Launcher

    def check(draft_device="cuda:0", draft_mem=0.85, max_model_len=0, tp=1):
        RuntimeConfig(target=ModelConfig(path="t", device="cuda:0", tensor_parallel_size=tp),
                      draft=ModelConfig(path="d", device=draft_device, gpu_memory_utilization=draft_mem),
                      spec=SpeculativeConfig(mode="sd"), sched=SchedulerConfig(max_model_len=max_model_len),
                      ).check_shared_gpu()

    # Both pools sized from memory on one GPU: 0.85 + 0.85 cannot both be had.
    with pytest.raises(ValueError, match="--draft-gpu-memory-utilization"):
        check()
    with pytest.raises(ValueError, match="shares cuda:1"):
        check(draft_device="cuda:1", tp=2)  # cuda:1 is the target's second rank
    check(draft_mem=0.1)  # shares that fit
    check(max_model_len=4096)  # the draft takes --max-num-seqs contexts of 4096 tokens only
    check(draft_device="cuda:1")  # a GPU of its own
    check(draft_device="cpu")
    # The launcher refuses before it starts anything (no GPU needed to see it).
    with pytest.raises(ValueError, match="shares cuda:0"):
        Launcher(RuntimeConfig(target=ModelConfig(path="t", device="cuda:0"), draft=ModelConfig(path="d", device="cuda"),
                               spec=SpeculativeConfig(mode="sd"), sched=SchedulerConfig(max_model_len=0)))
