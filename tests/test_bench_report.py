"""`spec-runtime bench`'s result keys (vLLM's), --percentile-metrics, --metric-percentiles
(numpy) and --plot, on made-up request results: no server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spec_runtime import bench_report, bench_serving
from spec_runtime.bench_serving import RequestResult, _check_args
from spec_runtime.cli import build_parser, main


def _args(*argv: str):
    args = build_parser().parse_args(["bench", *argv])
    _check_args(args)
    return args


def _results() -> list[RequestResult]:
    spec = {"mode": "sd", "k": 2, "num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6,
            "accepted_per_position": [4, 2], "drafted_per_position": [4, 4], "num_cache_hits": 0,
            "num_cache_misses": 0}
    ok = [RequestResult(ok=True, prompt_tokens=10, output_tokens=n, ttft_s=t, e2e_s=t + 0.01 * (n - 1),
                        itl_s=[0.01] * (n - 1), spec=spec)
          for n, t in ((5, 0.1), (9, 0.2), (3, 0.4), (7, 0.3))]
    return ok + [RequestResult(error="HTTP 400: too long")]


def test_vllm_result_keys_and_numpy_percentiles():
    args = _args("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99.9")
    res = bench_report.report(args, "m", _results(), duration=2.0)
    ttfts = [0.1, 0.2, 0.4, 0.3]
    assert res["completed"] == 4 and res["failed"] == 1 and res["duration"] == 2.0
    assert res["total_output_tokens"] == 24 and res["output_throughput"] == 12.0 and res["request_throughput"] == 2.0
    assert res["output_lens"] == [5, 9, 3, 7, 0] and res["errors"][-1] == "HTTP 400: too long"
    assert res["mean_ttft_ms"] == pytest.approx(1e3 * np.mean(ttfts))
    assert res["std_ttft_ms"] == pytest.approx(1e3 * np.std(ttfts))
    for p, word in ((50, "50"), (90, "90"), (99.9, "99.9")):
        assert res[f"p{word}_ttft_ms"] == pytest.approx(1e3 * np.percentile(ttfts, p))
        assert f"p{word}_e2el_ms" in res
    assert "mean_tpot_ms" not in res and "p99_ttft_ms" not in res  # only what was asked for
    assert res["spec_decode_acceptance_rate"] == 75.0 and res["spec_decode_acceptance_length"] == 2.5
    assert res["spec_decode_per_position_acceptance_rates"] == [1.0, 0.5]
    json.dumps(res)  # what --save-result writes
    text = bench_report.format_report(res)
    assert "P99.9 TTFT (ms):" in text and "Median E2EL (ms):" in text and "TPOT" not in text.split("Speculative")[0]


@pytest.mark.parametrize("argv,needle", [
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics: unknown ['latency']"),
    (["--metric-percentiles", "50,abc"], "--metric-percentiles must be comma-separated numbers"),
    (["--metric-percentiles", "0,101"], "in (0, 100]"),
])
def test_bad_bench_flags_fail_with_one_line(argv, needle, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    real = bench_report.importlib.util.find_spec
    monkeypatch.setattr(bench_report.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "--plot", "out.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = bench_report.report(_args(), "m", _results(), duration=2.0)
    out = tmp_path / "lat.png"
    bench_report.plot(res, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench_serving.format_report is bench_report.format_report
