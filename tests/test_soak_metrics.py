"""scripts/soak.py's metrics comparison: the server's request_success_total by finish
reason against the requests the soak sent, each counted exactly once, aborts included."""

from __future__ import annotations

import importlib.util
import os

from spec_runtime.server.metrics import ServerMetrics
from protocol.messages import RequestStats

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "soak.py")


def _soak():
    spec = importlib.util.spec_from_file_location("soak", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scrape(reasons: list[str]) -> str:
    m = ServerMetrics("soak", k=3)
    for r in reasons:
        m.observe_finished(RequestStats(), r, None, 0.1, 0)
    return m.render(None).decode()


def test_counts_match_and_mismatches_are_named():
    soak = _soak()
    by_reason = soak.success_counts(_scrape(["length"] * 5 + ["abort"] * 2))
    assert by_reason == {"length": 5, "abort": 2}
    # 7 sent: 5 ran to their end, 3 were aborted (one finished before its abort landed).
    assert soak.metrics_problems(by_reason, 7, 5, 3) == []
    assert soak.metrics_problems(by_reason, 8, 5, 3) == ["request_success_total counts 7 requests, 8 were sent"]
    assert "6 ran to their end" in soak.metrics_problems(by_reason, 7, 6, 3)[0]
    assert "more than the 1 aborted" in soak.metrics_problems(by_reason, 7, 5, 1)[0]
    errors = soak.success_counts(_scrape(["length", "error"]))
    assert "other than length and abort" in soak.metrics_problems(errors, 2, 1, 0)[0]
