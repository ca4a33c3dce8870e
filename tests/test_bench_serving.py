"""`spec-runtime serve` as a subprocess (ready line, serving, shutdown) and `spec-runtime bench` against it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import save_tiny_model
from e2e_util import wait_until
from spec_runtime import bench_serving
from spec_runtime.cli import build_parser

K = 3
KEY = "sk-bench"
READY = re.compile(r"spec-runtime: serving (\S+) on (http://127\.0\.0\.1:\d+)")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "spec_runtime", *args]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("bench") / "m", "llama")
    spec = json.dumps({"mode": "sd", "k": K, "draft_timeout_s": 30.0})
    proc = subprocess.Popen(
        _cli("serve", target, "--draft", target, "--speculative-config", spec, "--port", "0", "--api-key", KEY,
             "--served-model-name", "tiny", "--max-model-len", "256", "--max-batch-size", "8"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines: list[str] = []
    found: list[re.Match] = []

    def read():  # keep draining the pipe so the server never blocks on a full one
        for line in proc.stdout:
            lines.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no ready line; output:\n" + "".join(lines))
        time.sleep(0.05)
    yield found[0].group(1), found[0].group(2), proc, lines
    if proc.poll() is None:
        proc.kill()


def test_serve_prints_ready_line_and_serves(served):
    name, url, _, _ = served
    assert name == "tiny"
    # The ready line means it accepts requests now: no retry needed.
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["usage"]["spec_decode"]["k"] == K
    assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401


def test_bench_random_prompts_saves_json(served, tmp_path):
    _, url, _, _ = served
    out = tmp_path / "res.json"
    rc = subprocess.run(
        _cli("bench", "--base-url", url, "--api-key", KEY, "--num-prompts", "24", "--random-input-len", "8",
             "--output-len", "12", "--ignore-eos", "--max-concurrency", "6", "--save-result", str(out)),
        capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stdout + rc.stderr
    assert "Speculative Decoding" in rc.stdout and "Mean TTFT (ms)" in rc.stdout
    res = json.loads(out.read_text())
    assert res["completed"] == 24 and res["failed"] == 0
    assert res["total_output_tokens"] == 24 * 12 and res["total_input_tokens"] == 24 * 8
    assert res["output_lens"] == [12] * 24 and res["input_lens"] == [8] * 24 and res["errors"] == [""] * 24
    for key in ("ttft", "tpot", "itl", "e2el"):  # vLLM's flat keys
        assert 0 < res[f"median_{key}_ms"] <= res[f"p99_{key}_ms"] and res[f"mean_{key}_ms"] > 0
        assert res[f"std_{key}_ms"] >= 0
    assert res["median_e2el_ms"] >= res["median_ttft_ms"]
    sd = res["spec_decode"]
    assert sd["mode"] == "sd" and sd["k"] == K
    # draft == target: every draft token is accepted.
    assert sd["num_accepted_tokens"] == sd["num_draft_tokens"] > 0
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert 1.0 <= sd["mean_acceptance_length"] <= K + 1
    assert sd["acceptance_per_position"] == [1.0] * K
    assert res["spec_decode_acceptance_rate"] == 100.0
    assert res["spec_decode_acceptance_length"] == sd["mean_acceptance_length"]
    assert res["spec_decode_num_drafts"] == sd["num_drafts"]
    assert res["spec_decode_draft_tokens"] == res["spec_decode_accepted_tokens"] == sd["num_draft_tokens"]
    rates = res["spec_decode_per_position_acceptance_rates"]  # vLLM's: accepted at i over all drafts
    assert len(rates) == K and rates[0] == 1.0 and all(0 < r <= 1 for r in rates)
    assert res["request_throughput"] == pytest.approx(24 / res["duration"])


def test_bench_file_prompts_chat_at_a_rate(served, tmp_path):
    _, url, _, _ = served
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hello there", "What is the capital of France?")))
    args = build_parser().parse_args(
        ["bench", "--base-url", url, "--api-key", KEY, "--endpoint", "chat", "--dataset", str(data),
         "--num-prompts", "6", "--output-len", "5", "--ignore-eos", "--request-rate", "20"])
    res = bench_serving.run_benchmark_sync(args)
    assert res["completed"] == 6 and res["total_output_tokens"] == 30 and res["endpoint"] == "chat"
    text = bench_serving.format_report(res)
    assert "Acceptance length" in text and "Per-position acceptance" in text


def test_bench_reports_failures(served):
    _, url, _, _ = served
    # Every request over the context (256): reported per request, exit status 1.
    rc = subprocess.run(_cli("bench", "--base-url", url, "--api-key", KEY, "--num-prompts", "3", "--output-len", "300"),
                        capture_output=True, text=True, timeout=60)
    assert rc.returncode == 1 and "Failed requests:" in rc.stdout and "HTTP 400" in rc.stdout, rc.stdout + rc.stderr
    # No API key: the server refuses /v1/models, and bench says so instead of sending anything.
    args = build_parser().parse_args(["bench", "--base-url", url, "--num-prompts", "2"])
    with pytest.raises(ValueError, match="HTTP 401"):
        bench_serving.run_benchmark_sync(args)


def test_bench_ctrl_c_reports_and_saves_what_finished(served, tmp_path):
    _, url, _, _ = served
    out = tmp_path / "partial.json"
    # Enough work that the run cannot end before the interrupt arrives.
    auth = {"Authorization": f"Bearer {KEY}"}

    def generated() -> int:
        return httpx.get(url + "/v1/engine_stats", headers=auth).json()["totals"]["num_generated_tokens"]

    before = generated()
    proc = subprocess.Popen(_cli("bench", "--base-url", url, "--api-key", KEY, "--num-prompts", "2000",
                                 "--max-concurrency", "1", "--output-len", "60", "--ignore-eos",
                                 "--save-result", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # A shell's background job ignores SIGINT, and a child inherits that.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # A finished request: a count that only grows (one request at a time is seldom caught running).
    assert wait_until(lambda: proc.poll() is not None or generated() > before, 120), "no request finished in 120 s"
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("spec-runtime bench: interrupted after ") and str(out) in last, stderr
    assert "interrupted: partial" in stdout
    res = json.loads(out.read_text())
    assert res["interrupted"] and res["completed"] + res["failed"] < 2000
    assert f"after {res['completed'] + res['failed']} of 2000 requests" in last


def test_random_prompts_share_a_prefix_of_random_prefix_len():
    args = build_parser().parse_args(["bench", "--num-prompts", "5", "--random-input-len", "6",
                                      "--random-prefix-len", "10"])
    prompts = bench_serving.load_prompts(args, 50, [2])
    assert all(len(p) == 16 and p[:10] == prompts[0][:10] and 2 not in p for p in prompts)
    assert len({tuple(p[10:]) for p in prompts}) == 5


def test_speculative_config_rejects_unknown_keys():
    for spec, needle in (('{"mode": "sd", "kk": 3}', "unknown keys ['kk']"), ("[1]", "JSON object"),
                         ('{"k": 5}', "a flag sets it")):
        rc = subprocess.run(_cli("serve", "m", "--k", "4", "--speculative-config", spec), capture_output=True,
                            text=True, timeout=60)
        assert rc.returncode == 2 and needle in rc.stderr, rc.stderr


def test_serve_shuts_down_on_sigint(served):
    _, url, proc, lines = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0, "".join(lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_serve_exits_nonzero_when_the_target_dies(tmp_path):
    """--on-target-death exit (the default): a supervisor sees exit code 1 and restarts it."""
    import psutil

    target = save_tiny_model(tmp_path / "m", "llama")
    proc = subprocess.Popen(_cli("serve", target, "--mode", "ar", "--port", "0", "--max-model-len", "128"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        # readline blocks; a hung server is ended by the timeout of communicate() below at worst
        for line in proc.stdout:
            if READY.search(line):
                break
        else:
            pytest.fail("the server exited without a ready line")
        children = psutil.Process(proc.pid).children()
        target_proc = next(c for c in children if "spec_runtime.child_boot target" in " ".join(c.cmdline()))
        target_proc.kill()
        rc = proc.wait(timeout=30)
        assert rc == 1
        assert "target process died" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
