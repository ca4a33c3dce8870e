"""The CLI's flags: every one has help and a default, and every bad value is rejected
before any process starts, one line per problem, exit code 2."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from protocol.messages import RequestStats, SamplingParams
from spec_runtime.cli import _cap_max_tokens, _summary, build_parser, main
from spec_runtime.cli_flags import ConfigErrors, config_from_args
from spec_runtime.client import GenerationResult
from spec_runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_has_help_with_its_default(command):
    for action in _subparser(command)._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "--help" in action.option_strings:
            continue
        assert action.help and action.help.strip(), action.option_strings
        if command == "generate" and action.dest not in ("raw", "json"):
            assert "(default: " in action.help, (action.option_strings, action.help)


def _help(command: str, flag: str) -> str:
    return next(a.help for a in _subparser(command)._actions if flag in a.option_strings)


def test_help_texts_say_what_the_flags_do():
    draft = _help("generate", "--draft")
    assert '"ngram"' in draft and "smollm2-draft.gguf" in draft and "else ngram)" in draft
    assert "SmolLM2" in _help("generate", "--target")
    assert "BENCH.md" not in _help("generate", "--synthetic-acceptance")
    assert "SpecResponse" not in _help("generate", "--draft-top-k")
    for flag in ("--max-tokens", "--temperature", "--top-k", "--top-p"):
        assert "(default: " in _help("generate", flag)


@pytest.mark.parametrize("flags,expected", [
    (["--temperature", "-1"], ["--temperature must be >= 0"]),
    (["--top-p", "2"], ["--top-p must be in (0, 1]"]),
    (["--top-k", "-1"], ["--top-k must be in"]),
    (["--max-tokens", "0"], ["--max-tokens must be >= 1"]),
    (["--k", "0"], ["--k must be in [1, 32]"]),
    (["--mode", "ssd", "--draft", "ngram"], ["--mode ssd needs a draft model"]),
    (["--fan-out", "1,2"], ["--fan-out needs K+1"]),
    (["--target", "/does/not/exist"], ["--target /does/not/exist: no such file or directory"]),
    (["--k", "0", "--top-p", "0", "--max-model-len", "8", "--log-level", "LOUD"],
     ["--k must be", "--max-model-len must be >= 16", "--top-p must be", "--log-level must be"]),
])
def test_bad_flags_fail_before_start_one_line_each(flags, expected, capsys):
    assert main(["generate", "hi", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(expected), err
    for line in err:
        assert line.startswith("spec-runtime generate: error: ")
    for want in expected:
        assert any(want in line for line in err), (want, err)


def test_serve_checks_its_flags_too(capsys):
    assert main(["serve", "--port", "70000", "--k", "0", "--target", "/does/not/exist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("spec-runtime serve: error: ") for line in err), err
    assert any("--port must be in [0, 65535]" in line for line in err)


def test_serve_chat_flags_are_checked(capsys, tmp_path):
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "neither a file nor a Jinja template" in err
    assert main(["serve", "--tool-call-parser", "xml"]) == 2
    assert "--tool-call-parser must be auto, hermes or llama3_json, got 'xml'" in capsys.readouterr().err
    # The same checks with --ray (whose replicas honour the chat flags).
    assert main(["serve", "--ray", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_bad_flags_load_nothing():
    """The checks run in the command's own process, before torch or a child is started."""
    code = ("import sys; from spec_runtime.cli import main; rc = main(['generate', 'hi', '--temperature', '-1']); "
            "assert 'torch' not in sys.modules and 'spec_runtime.launcher' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "spec-runtime generate: error: --temperature must be >= 0, got -1.0"


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "hi", "--k", "four"])
    assert e.value.code == 2


def test_max_tokens_beyond_the_context_is_capped_with_a_warning(capsys):
    sp = _cap_max_tokens(SamplingParams(max_tokens=100_000), num_prompt_tokens=30, max_model_len=2048)
    assert sp.max_tokens == 2048 - 30
    assert "generating at most 2018" in capsys.readouterr().err
    sp = _cap_max_tokens(SamplingParams(max_tokens=10), num_prompt_tokens=30, max_model_len=2048)
    assert sp.max_tokens == 10 and capsys.readouterr().err == ""
    with pytest.raises(ConfigErrors, match="fills the context"):
        _cap_max_tokens(SamplingParams(max_tokens=10), num_prompt_tokens=2048, max_model_len=2048)


def test_summary_line_and_acceptance_length():
    stats = RequestStats(num_generated_tokens=9, num_rounds=5, num_draft_tokens=12, num_accepted_tokens=4,
                         accepted_per_position=[3, 1, 0, 0], drafted_per_position=[3, 3, 3, 3], e2e_s=1.0)
    st = GenerationResult("", [], "length", stats).stats_dict()
    assert st["num_drafts"] == 3
    assert st["mean_acceptance_length"] == pytest.approx(1 + 4 / 3, abs=1e-4)  # 1 + accepted / drafts
    line = _summary(RuntimeConfig(draft=ModelConfig(path="ngram")), st, "length")
    assert line.startswith("[sd, draft ngram, K=4] 9 tokens") and "acceptance length 2.33" in line
    ar = _summary(RuntimeConfig(spec=SpeculativeConfig(mode="ar")), st, "stop")
    assert ar.startswith("[ar] 9 tokens") and "K=" not in ar


def test_generate_json_caps_max_tokens_and_reports_startup_phases(tiny_llama_dir, capsys):
    import json

    rc = main(["generate", "Hello", "--raw", "--json", "--target", tiny_llama_dir, "--draft", tiny_llama_dir,
               "--max-model-len", "32", "--max-tokens", "100000", "--k", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "--max-tokens 100000 is more than the context leaves" in err
    res = json.loads(out)
    num_prompt = res["stats"]["num_prompt_tokens"]
    assert res["finish_reason"] in ("length", "stop") and len(res["token_ids"]) <= 32 - num_prompt
    assert set(res["startup"]["target"]) == {"load_s", "kv_alloc_s", "graph_capture_s", "ready_s"}
    assert set(res["startup"]["draft"]) == {"ready_s"}
    assert res["startup"]["target"]["ready_s"] >= res["startup"]["target"]["load_s"] > 0
    st = res["stats"]
    assert st["mean_acceptance_length"] == pytest.approx(1 + st["num_accepted_tokens"] / st["num_drafts"], abs=1e-4)


@pytest.mark.parametrize("flags,expected", [
    (["--mode", "sd", "--work-ahead", "halves", "--tree-budget", "32"],
     ["--tree-budget does nothing with --mode sd (SSD only)", "--work-ahead does nothing with --mode sd (SSD only)"]),
    (["--mode", "ar", "--backup", "jit", "--k", "3", "--draft", "ngram", "--dtype", "float32"],
     ["--backup does nothing with --mode ar (SSD only)", "--k does nothing with --mode ar (no draft)",
      "--draft does nothing with --mode ar (no draft)"]),
    (["--mode", "ssd", "--work-ahead", "halves", "--k", "3", "--dtype", "float32"], []),
])
def test_flags_the_mode_does_not_read_are_named_in_a_warning(flags, expected, capsys):
    """One set of flags can run every mode; what a mode does not read is said, once, before loading."""
    cfg = config_from_args(build_parser().parse_args(["generate", "hi", *flags]))
    assert cfg.spec.mode == flags[1]
    assert capsys.readouterr().err.splitlines() == [f"spec-runtime: warning: {line}" for line in expected]
