"""scripts/trace_gaps.py: the GPU's idle time inside a host window, charged to the
innermost host region active at the time."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from trace_gaps import gaps_by_label, main  # noqa: E402


def _region(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _kernel(ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}


def _events():
    # Two windows of 100 us. In the first the host is in "glue" for [0, 30) and in
    # "fork" inside it for [20, 30), then "steps" for [30, 100); kernels cover [0, 20)
    # and [40, 90) (two overlapping kernels) and a copy [90, 95).
    first = [_region("work_ahead", 0, 100), _region("glue", 0, 30), _region("fork", 20, 10),
             _region("steps", 30, 70), _kernel(0, 20), _kernel(40, 30), _kernel(60, 30),
             _kernel(90, 5, "gpu_memcpy")]
    # The second: no inner region; one kernel [1010, 1090), one starting before the window.
    second = [_region("work_ahead", 1000, 100), _kernel(990, 20), _kernel(1050, 40),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000, "dur": 100}]
    return first + second


def test_idle_time_goes_to_the_innermost_region():
    r = gaps_by_label(_events(), "work_ahead")
    assert r["windows"] == 2
    # Busy: first window 20 + 50 + 5 = 75 us; second 10 + 40 = 50 us.
    assert r["window_ms"] == pytest.approx(0.1)
    assert r["gpu_busy_ms"] == pytest.approx((75 + 50) / 2 / 1e3)
    labels = r["labels"]
    # Idle in the first window: [20, 40) (fork [20, 30), steps [30, 40)) and [95, 100)
    # (steps); in the second: [1010, 1050) and [1090, 1100), no region.
    assert labels["fork"]["gpu_idle_ms"] == pytest.approx(10 / 2 / 1e3)
    assert labels["steps"]["gpu_idle_ms"] == pytest.approx(15 / 2 / 1e3)
    assert labels["glue"]["gpu_idle_ms"] == 0.0
    assert labels["unlabelled"]["gpu_idle_ms"] == pytest.approx(50 / 2 / 1e3)
    assert labels["glue"]["host_ms"] == pytest.approx(30 / 2 / 1e3)


def test_cli_reads_a_gzipped_trace_and_names_a_missing_window(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _events()}, f)
    main([str(path), "--window", "work_ahead"])
    out = capsys.readouterr().out
    assert "2 x work_ahead: 0.100 ms each, GPU busy 0.062 ms" in out
    assert out.splitlines()[2].startswith("unlabelled")  # the most idle first
    with pytest.raises(ValueError, match="no host region named 'nope'"):
        main([str(path), "--window", "nope"])
