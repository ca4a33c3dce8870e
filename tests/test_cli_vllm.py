"""vLLM's names on `spec-runtime generate|serve`: aliases, --config FILE.yaml, vLLM's
--speculative-config keys, --generation-config, SPEC_RUNTIME_API_KEY and Hugging Face ids
from the local cache. Each is accepted into the config, or refused with one line (exit 2)
before any process starts; nothing here starts a model (run_server is replaced)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from spec_runtime.cli import build_parser, main
from spec_runtime.cli_config import apply_speculative_config, expand_config_file
from spec_runtime.cli_flags import config_from_args
from spec_runtime.server.generation_config import apply_generation_defaults, load_generation_defaults
from spec_runtime.server.openai_protocol import CompletionRequest, parse_request


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {c: sub.choices[c] for c in ("generate", "serve")}


def _cfg(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def _errors(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith(f"spec-runtime {argv[0]}: error: ") for line in lines), lines
    return lines


@pytest.fixture
def served(monkeypatch):
    """main(["serve", ...]) up to the point where the server would start: run_server's
    arguments (the AppOptions' fields among them)."""
    calls = []

    def fake_run_server(cfg, options, **kw):
        calls.append((cfg, {**kw, **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}}))
        return 0

    monkeypatch.setattr("spec_runtime.server.serve.run_server", fake_run_server)
    return calls


# ---------------------------------------------------------------- aliases


def test_vllm_aliases_set_the_same_fields():
    cfg = _cfg("--max-num-seqs", "3", "--max-model-len", "512", "--dtype", "float16", "--seed", "7",
               "--gpu-memory-utilization", "0.5")
    assert cfg.sched.max_batch_size == 3 and cfg.sched.max_model_len == 512 and cfg.seed == 7
    assert cfg.target.dtype == cfg.draft.dtype == "float16"
    assert cfg.target.gpu_memory_utilization == 0.5 and cfg.draft.gpu_memory_utilization == 0.85
    # A role's own flag wins over the vLLM-wide one.
    cfg = _cfg("--dtype", "float16", "--draft-dtype", "float32")
    assert (cfg.target.dtype, cfg.draft.dtype) == ("float16", "float32")
    assert _cfg().sched.max_batch_size == 0  # unset: sized at start-up (tests/test_sizing.py)


@pytest.mark.parametrize("argv,needle", [
    (["--max-num-seqs", "-1"], "--max-batch-size must be >= 1"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in [0.05, 0.99], got 2.0"),
    (["--speculative-config", '{"method": "eagle"}'], "method 'eagle' is not supported"),
    (["--speculative-config", '{"method": "ngram", "model": "/m"}'], "method ngram takes no model"),
    (["--speculative-config", '{"method": "draft_model"}'], "method draft_model needs \"model\""),
    (["--speculative-config", '{"num_speculative_tokens": 3, "k": 4}'], "sets k twice"),
    (["--k", "2", "--speculative-config", '{"num_speculative_tokens": 3}'], "a flag sets it to 2"),
    (["--speculative-config", '{"num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}'],
     "unknown keys ['draft_tensor_parallel_size']"),
    (["--target", "NoSuchOrg/no-such-model-here"], "not in the Hugging Face cache"),
    (["--ray", "--header-timeout-s", "5"], "--header-timeout-s does not apply with --ray"),
])
def test_bad_vllm_flags_fail_before_start_one_line(argv, needle, capsys, served):
    lines = _errors(capsys, "serve", "--port", "1", *argv)
    assert len(lines) == 1 and needle in lines[0], lines
    assert not served


def test_argparse_refuses_bad_choices(capsys):
    for argv in (["--dtype", "float8"], ["--generation-config", "sometimes"], ["--metrics-prefix", "sglang"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", *argv])
        assert e.value.code == 2
        assert argv[0] in capsys.readouterr().err


def test_draft_help_names_ngram_and_the_default():
    h = next(a.help for a in _subparsers()["serve"]._actions if "--draft" in a.option_strings)
    assert '"ngram"' in h and "shipped with spec-runtime" in h


# ---------------------------------------------------------------- --speculative-config


def test_speculative_config_takes_vllms_keys():
    args = build_parser().parse_args(["serve"])
    apply_speculative_config(args, json.dumps({"method": "ngram", "num_speculative_tokens": 5,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 2}))
    cfg = config_from_args(args)
    assert (cfg.spec.k, cfg.spec.ngram_max, cfg.spec.ngram_min, cfg.draft_name) == (5, 3, 2, "ngram")
    args = build_parser().parse_args(["serve"])
    apply_speculative_config(args, json.dumps({"model": "/models/draft", "num_speculative_tokens": 2,
                                               "mode": "ssd"}))
    cfg = config_from_args(args)
    assert (cfg.draft.path, cfg.spec.k, cfg.spec.mode) == ("/models/draft", 2, "ssd")


# ---------------------------------------------------------------- --config FILE.yaml


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max-num-seqs: 3\nmax_model_len: 512\nk: 2\ntarget-cuda-graphs: false\ndraft-top-k: 8\n"
                 "speculative-config: {num_speculative_tokens: 2}\nhost: 127.0.0.2\n")
    argv = expand_config_file(_subparsers(), ["serve", "--config", str(f), "--max-num-seqs", "5"])
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    assert cfg.sched.max_batch_size == 5  # the flag, not the file
    assert cfg.sched.max_model_len == 512 and cfg.spec.k == 2 and cfg.spec.draft_top_k == 8
    assert cfg.target.cuda_graphs is False and args.host == "127.0.0.2"
    assert json.loads(args.speculative_config) == {"num_speculative_tokens": 2}


def test_config_file_model_key_is_the_target(tmp_path, tiny_llama_dir, served):
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {tiny_llama_dir}\nmode: ar\nmax-num-seqs: 2\n")
    assert main(["serve", "--config", str(f), "--port", "0"]) == 0
    cfg, _ = served[0]
    assert cfg.target.path == str(tiny_llama_dir) and cfg.sched.max_batch_size == 2


@pytest.mark.parametrize("content,needle", [
    ("bogus: 1\nmax-num-seqs: 2\nother_thing: x\n", "unknown keys ['bogus', 'other_thing']"),
    ("max-num-seqs: [unclosed\n", "not valid YAML"),
    ("- a\n- b\n", "mapping of flag names"),
    ("target-cuda-graphs: maybe\n", "target-cuda-graphs must be true or false"),
    ("max-num-seqs: -1\n", "--max-batch-size must be >= 1"),
])
def test_bad_config_files_fail_before_start_one_line(content, needle, tmp_path, capsys, served):
    f = tmp_path / "c.yaml"
    f.write_text(content)
    lines = _errors(capsys, "serve", "--port", "1", "--config", str(f))
    assert len(lines) == 1 and needle in lines[0], lines
    lines = _errors(capsys, "serve", "--config", str(tmp_path / "missing.yaml"))
    assert len(lines) == 1 and "missing.yaml" in lines[0]
    assert not served


def test_bad_config_file_loads_nothing(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("bogus: 1\n")
    code = (f"import sys; from spec_runtime.cli import main; rc = main(['serve', '--config', {str(f)!r}]); "
            "assert 'torch' not in sys.modules and 'spec_runtime.launcher' not in sys.modules; sys.exit(rc)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 2


# ---------------------------------------------------------------- API key, generation config, HF ids


def test_api_key_from_the_environment(monkeypatch, tiny_llama_dir, served):
    monkeypatch.setenv("SPEC_RUNTIME_API_KEY", "sk-env")
    assert main(["serve", str(tiny_llama_dir), "--mode", "ar", "--port", "0"]) == 0
    assert served[-1][1]["api_key"] == "sk-env"
    assert main(["serve", str(tiny_llama_dir), "--mode", "ar", "--port", "0", "--api-key", "sk-flag"]) == 0
    assert served[-1][1]["api_key"] == "sk-flag"  # the flag wins
    assert served[-1][1]["metrics_prefix"] == "spec_runtime"


def _with_generation_config(src, dst, cfg: dict):
    import shutil

    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(cfg))
    return dst


def test_generation_config_auto_none_and_bad(tmp_path, tiny_llama_dir, served, capsys):
    model = _with_generation_config(tiny_llama_dir, tmp_path / "m", {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
        "bos_token_id": 1})
    assert main(["serve", str(model), "--mode", "ar", "--port", "0", "--metrics-prefix", "vllm"]) == 0
    kw = served[-1][1]
    assert kw["generation_defaults"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert kw["metrics_prefix"] == "vllm"
    assert "temperature=0.6" in capsys.readouterr().err  # said, not applied silently
    for mode in ("none", "vllm"):
        assert main(["serve", str(model), "--mode", "ar", "--port", "0", "--generation-config", mode]) == 0
        assert served[-1][1]["generation_defaults"] == {}
    bad = _with_generation_config(tiny_llama_dir, tmp_path / "bad", {"temperature": -1})
    lines = _errors(capsys, "serve", str(bad), "--mode", "ar")
    assert len(lines) == 1 and "generation_config.json" in lines[0] and "temperature must be >= 0" in lines[0]


def test_generation_defaults_fill_only_what_the_request_leaves_unset():
    assert load_generation_defaults("auto", "/no/such/dir") == {}  # a .gguf or the embedded model: none
    defaults = {"temperature": 0.6, "top_k": 20, "min_p": 0.1}
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "temperature": 1.0, "top_k": None})
    got = apply_generation_defaults(req, defaults)
    assert (got.temperature, got.top_k, got.min_p, got.top_p) == (1.0, 20, 0.1, None)


def test_hf_id_resolves_from_the_local_cache(tmp_path, tiny_llama_dir, monkeypatch, served):
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--someorg--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert main(["serve", "someorg/tiny-llama", "--mode", "ar", "--port", "0"]) == 0
    cfg, kw = served[-1]
    assert cfg.target.path == str(repo / "snapshots" / commit)
    assert kw["served_model_name"] == "someorg/tiny-llama"  # clients send the id, as with vLLM
