"""Where the GPU waits for the host: idle time of a chrome trace (torch.profiler's
export_chrome_trace) inside labelled host regions.

    python scripts/trace_gaps.py TRACE.json --window work_ahead

For each occurrence of the window label (a `torch.profiler.record_function` region on
the host), the GPU's busy time is the union of its kernels, copies and sets that overlap
the window; every idle stretch is charged to the innermost other label the host was in
at that moment ("unlabelled" where none). Printed per label: the host's time in it and
the GPU's idle time while the host was there, as means over the windows.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _intervals(events, cats) -> list[tuple[float, float]]:
    out = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("ph") == "X" and e.get("cat") in cats)
    merged: list[list[float]] = []
    for a, b in out:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _idle(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The stretches of [lo, hi) that no busy interval covers."""
    gaps, t = [], lo
    for a, b in busy:
        if b <= t:
            continue
        if a >= hi:
            break
        if a > t:
            gaps.append((t, min(a, hi)))
        t = max(t, b)
        if t >= hi:
            break
    if t < hi:
        gaps.append((t, hi))
    return gaps


def gaps_by_label(events: list[dict], window: str) -> dict:
    """{"windows": n, "window_ms", "gpu_busy_ms", "labels": {label: {"host_ms", "gpu_idle_ms"}}},
    times as means per window (module doc)."""
    regions = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in regions if e["name"] == window)
    if not windows:
        raise ValueError(f"no host region named {window!r} in the trace")
    inner = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in regions if e["name"] != window]
    busy = _intervals(events, GPU_CATS)
    host, idle = defaultdict(float), defaultdict(float)
    total = busy_total = 0.0
    for lo, hi in windows:
        total += hi - lo
        gaps = _idle(busy, lo, hi)
        busy_total += (hi - lo) - sum(b - a for a, b in gaps)
        mine = [r for r in inner if r[0] < hi and r[1] > lo]
        for a, b, name in mine:
            host[name] += min(b, hi) - max(a, lo)
        for a, b in gaps:
            # Split the gap at every region edge; charge each piece to the innermost
            # (shortest) region covering it.
            cuts = sorted({a, b, *(x for r in mine for x in r[:2] if a < x < b)})
            for x, y in zip(cuts, cuts[1:]):
                over = [r for r in mine if r[0] <= x and r[1] >= y]
                name = min(over, key=lambda r: r[1] - r[0])[2] if over else "unlabelled"
                idle[name] += y - x
    n = len(windows)
    return {"windows": n, "window_ms": total / n / 1e3, "gpu_busy_ms": busy_total / n / 1e3,
            "labels": {k: {"host_ms": host.get(k, 0.0) / n / 1e3, "gpu_idle_ms": idle.get(k, 0.0) / n / 1e3}
                       for k in sorted(set(host) | set(idle))}}


def format_report(r: dict, window: str) -> str:
    lines = [f"{r['windows']} x {window}: {r['window_ms']:.3f} ms each, GPU busy {r['gpu_busy_ms']:.3f} ms, "
             f"idle {r['window_ms'] - r['gpu_busy_ms']:.3f} ms",
             f"{'host region':<24} {'host ms':>8} {'GPU idle ms':>12}"]
    for name, v in sorted(r["labels"].items(), key=lambda kv: -kv[1]["gpu_idle_ms"]):
        lines.append(f"{name:<24} {v['host_ms']:>8.3f} {v['gpu_idle_ms']:>12.3f}")
    return "\n".join(lines)


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--window", required=True, help="the host region whose occurrences are analysed")
    args = p.parse_args(argv)
    print(format_report(gaps_by_label(load(args.trace), args.window), args.window))


if __name__ == "__main__":
    main()
