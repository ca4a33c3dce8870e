"""`spec-runtime bench`'s results: vLLM's flat result keys, the printed report, and --plot.

Keys follow `vllm bench serve`'s result JSON: duration, completed, failed,
total_input_tokens, total_output_tokens, request_throughput, output_throughput,
total_token_throughput, input_lens, output_lens, ttfts, itls, latencies, errors, and for
each metric chosen by --percentile-metrics (ttft, tpot, itl, e2el) `mean_<m>_ms`,
`median_<m>_ms`, `std_<m>_ms` and `p<P>_<m>_ms` for each P of --metric-percentiles
(numpy's percentile, linear interpolation). The speculative-decoding keys are vLLM's too
(spec_decode_acceptance_rate in %, spec_decode_acceptance_length, ...), summed from each
response's `usage.spec_decode` rather than scraped from /metrics; `spec_decode` holds this
runtime's fuller summary (mode, K, cache hit rate, acceptance per position).
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from protocol.messages import mean_acceptance_length

PERCENTILE_METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                      "itl": "Inter-token Latency (per streamed chunk)", "e2el": "End-to-end Latency"}


def parse_percentile_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics: unknown {bad or 'empty list'}; choose from "
                         f"{', '.join(PERCENTILE_METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles must be numbers in (0, 100], got {text!r}")
    return ps


def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib")


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def spec_summary(specs: list[dict]) -> dict:
    """Acceptance over all requests: sums of counts, then ratios (not a mean of ratios)."""
    tot = {k: sum(s.get(k, 0) for s in specs) for k in
           ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_cache_hits", "num_cache_misses")}
    k = max((len(s.get("drafted_per_position", [])) for s in specs), default=0)
    acc = [sum(s["accepted_per_position"][i] for s in specs if i < len(s.get("accepted_per_position", [])))
           for i in range(k)]
    dra = [sum(s["drafted_per_position"][i] for s in specs if i < len(s.get("drafted_per_position", [])))
           for i in range(k)]
    looks = tot["num_cache_hits"] + tot["num_cache_misses"]
    return {
        "mode": specs[0].get("mode") if specs else None,
        "k": specs[0].get("k") if specs else None,
        **tot,
        "acceptance_rate": tot["num_accepted_tokens"] / tot["num_draft_tokens"] if tot["num_draft_tokens"] else 0.0,
        "mean_acceptance_length": mean_acceptance_length(tot["num_accepted_tokens"], tot["num_drafts"]),
        "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(acc, dra)],
        "accepted_per_position": acc,
        "cache_hit_rate": tot["num_cache_hits"] / looks if looks else None,
    }


def report(args, model: str, results: list, duration: float, interrupted: bool = False) -> dict:
    """The result dict (what --save-result writes) of finished RequestResults."""
    metric_names = getattr(args, "percentile_metrics_list", None) or parse_percentile_metrics(args.percentile_metrics)
    percentiles = getattr(args, "percentiles_list", None) or parse_metric_percentiles(args.metric_percentiles)
    ok = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    values = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl_s],
        "e2el": [r.e2e_s for r in ok],
    }
    res = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "spec-runtime", "model_id": model,
        "base_url": args.base_url, "endpoint": args.endpoint, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "output_len": args.output_len, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "interrupted": interrupted,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft_s for r in results], "itls": [r.itl_s for r in results],
        "latencies": [r.e2e_s for r in results], "errors": [r.error for r in results],
        "percentile_metrics": metric_names, "metric_percentiles": percentiles,
    }
    for name in metric_names:
        v = values[name] or [0.0]
        res[f"mean_{name}_ms"] = float(np.mean(v)) * 1e3
        res[f"median_{name}_ms"] = float(np.median(v)) * 1e3
        res[f"std_{name}_ms"] = float(np.std(v)) * 1e3
        for p in percentiles:
            res[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(v, p)) * 1e3
    sd = spec_summary([r.spec for r in ok if r.spec])
    res["spec_decode"] = sd
    if sd["num_draft_tokens"]:
        res.update(
            spec_decode_acceptance_rate=100.0 * sd["acceptance_rate"],
            spec_decode_acceptance_length=sd["mean_acceptance_length"],
            spec_decode_num_drafts=sd["num_drafts"], spec_decode_draft_tokens=sd["num_draft_tokens"],
            spec_decode_accepted_tokens=sd["num_accepted_tokens"],
            # vLLM's per-position rate: accepted at the position over all drafts.
            spec_decode_per_position_acceptance_rates=[a / sd["num_drafts"] for a in sd["accepted_per_position"]],
        )
    return res


def format_report(res: dict) -> str:
    title = " Serving Benchmark Result (interrupted: partial) " if res.get("interrupted") else " Serving Benchmark Result "
    lines = [f"{title:=^60}"]

    def row(name, value, fmt="{:.2f}"):
        lines.append(f"{name:<44}{fmt.format(value) if value is not None else 'n/a':>16}")

    row("Successful requests:", res["completed"], "{}")
    row("Failed requests:", res["failed"], "{}")
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"], "{}")
    row("Total generated tokens:", res["total_output_tokens"], "{}")
    row("Request throughput (req/s):", res["request_throughput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for name in res["percentile_metrics"]:
        lines.append(f"{' ' + PERCENTILE_METRICS[name] + ' ':-^60}")
        label = name.upper()
        row(f"Mean {label} (ms):", res[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", res[f"median_{name}_ms"])
        for p in res["metric_percentiles"]:
            row(f"P{_p_word(p)} {label} (ms):", res[f"p{_p_word(p)}_{name}_ms"])
    sd = res["spec_decode"]
    lines.append(f"{' Speculative Decoding ':-^60}")
    row("Mode / K:", f"{sd.get('mode')} / {sd.get('k')}", "{}")
    row("Drafts (rounds with a proposal):", sd.get("num_drafts", 0), "{}")
    row("Draft tokens:", sd.get("num_draft_tokens", 0), "{}")
    row("Accepted tokens:", sd.get("num_accepted_tokens", 0), "{}")
    row("Acceptance rate:", sd.get("acceptance_rate", 0.0))
    row("Acceptance length (1 + accepted/drafts):", sd.get("mean_acceptance_length", 1.0))
    row("Cache hit rate:", sd.get("cache_hit_rate"))
    per = ", ".join(f"{x:.2f}" for x in sd.get("acceptance_per_position", []))
    lines.append(f"{'Per-position acceptance:':<28}{'[' + per + ']':>32}")
    errors = sorted({e for e in res["errors"] if e})[:10]
    if errors:
        lines.append("Errors: " + "; ".join(errors))
    lines.append("=" * 60)
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    """A PNG with one histogram per latency metric (ms), its mean and percentiles marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [not e for e in res["errors"]]
    rows = [(t, e, n, itl) for t, e, n, itl, good in
            zip(res["ttfts"], res["latencies"], res["output_lens"], res["itls"], ok) if good]
    series = {"ttft": [t for t, _, _, _ in rows], "tpot": [(e - t) / (n - 1) for t, e, n, _ in rows if n > 1],
              "itl": [x for *_, itl in rows for x in itl], "e2el": [e for _, e, _, _ in rows]}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        ms = np.asarray(values, dtype=float) * 1e3
        ax.set_title(f"{PERCENTILE_METRICS[name]} ({len(ms)} samples)", fontsize=10)
        ax.set_xlabel("ms")
        if len(ms):
            mid = float(np.mean(ms))
            if float(np.ptp(ms)) > 1e-6 * max(1.0, abs(mid)):
                ax.hist(ms, bins=40, color="#4c72b0")
            else:  # all equal (to rounding): one bar around the value
                ax.hist(ms, bins=1, range=(mid - 0.5, mid + 0.5), color="#4c72b0")
            ax.axvline(float(np.mean(ms)), color="black", linestyle="--", label=f"mean {np.mean(ms):.1f}")
            for p in res["metric_percentiles"]:
                ax.axvline(float(np.percentile(ms, p)), color="#c44e52", linestyle=":",
                           label=f"p{_p_word(p)} {np.percentile(ms, p):.1f}")
            ax.legend(fontsize=8)
    sd = res["spec_decode"]
    fig.suptitle(f"spec-runtime bench: {res['model_id']}, {res['completed']} requests, "
                 f"{res['output_throughput']:.1f} tok/s, mode {sd.get('mode')}, "
                 f"acceptance length {sd.get('mean_acceptance_length', 1.0):.2f}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
