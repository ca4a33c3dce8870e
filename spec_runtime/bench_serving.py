"""`spec-runtime bench`: a load generator for a running `spec-runtime serve`.

Sends --num-prompts streaming requests, either at --request-rate (Poisson arrivals;
inf = all at once) and/or capped at --max-concurrency in flight, with random prompts
(token ids drawn uniformly from the vocabulary the server reports, EOS excluded; with
the chat endpoint, random words) or prompts from a file (JSONL with a "prompt" field,
or one prompt per line). It reports throughput; TTFT, TPOT, ITL and end-to-end latency
(mean, median, p99); and a Speculative Decoding section summed from each response's
`usage.spec_decode`. --save-result writes everything as JSON. A progress bar counts
finished requests on stderr; Ctrl-C stops the run and reports (and saves) what finished.

ITL is the gap between streamed chunks: with speculation one chunk carries every token
a round accepted, so ITL is per round, and TPOT (per token) is the fairer comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import dataclass, field

from protocol.messages import mean_acceptance_length

logger = logging.getLogger(__name__)

_WORDS = ("the quick brown fox jumps over lazy dog speculative decoding drafts tokens small model verifies them "
          "large one hello world what is capital of france paris one two three four five six seven eight").split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    spec: dict = field(default_factory=dict)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", default="random", help="'random', or a file: JSONL with a \"prompt\" field, or lines")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=32, help="prompt tokens (words for chat) of random prompts")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens (extension field)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    p.add_argument("--save-result", default=None, metavar="PATH",
                   help="write the results as JSON to PATH (partial ones too, on Ctrl-C)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


@dataclass
class _Run:
    """What a run has so far, readable after Ctrl-C."""

    model: str = ""
    t0: float = 0.0
    results: list[RequestResult] = field(default_factory=list)


def load_prompts(args, vocab_size: int, eos_ids: list[int]) -> list:
    rng = random.Random(args.seed)
    if args.dataset != "random":
        prompts = []
        with open(args.dataset, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                prompts.append(json.loads(line)["prompt"] if line.startswith("{") else line)
        if not prompts:
            raise ValueError(f"{args.dataset} holds no prompts")
        return [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    if args.endpoint == "chat":
        return [" ".join(rng.choice(_WORDS) for _ in range(args.random_input_len)) for _ in range(args.num_prompts)]
    allowed = [t for t in range(vocab_size) if t not in set(eos_ids)]
    return [[rng.choice(allowed) for _ in range(args.random_input_len)] for _ in range(args.num_prompts)]


async def _one(http, args, model: str, prompt) -> RequestResult:
    res = RequestResult()
    body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", path, json=body, timeout=args.timeout_s) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    res.error = obj["error"].get("message", "error")
                    return res
                if obj.get("usage"):
                    u = obj["usage"]
                    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.spec = u.get("spec_decode") or {}
                if obj.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e_s = time.perf_counter() - t0
    res.ok = True
    return res


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    v = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, as numpy.percentile
        x = q / 100 * (len(v) - 1)
        lo = int(x)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return {"mean_ms": 1e3 * sum(v) / len(v), "median_ms": 1e3 * pct(50), "p99_ms": 1e3 * pct(99)}


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
        "cache_hit_rate": tot["num_cache_hits"] / looks if looks else None,
    }


async def benchmark(args, run: _Run | None = None) -> dict:
    import httpx
    from tqdm.auto import tqdm

    run = run if run is not None else _Run()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits) as http:
        r = await http.get("/v1/models")
        if r.status_code != 200:
            raise ValueError(f"GET {args.base_url}/v1/models: HTTP {r.status_code}: {r.text[:300]}")
        card = r.json()["data"][0]
        model = run.model = args.model or card["id"]
        ext = card.get("spec_runtime", {})
        prompts = load_prompts(args, ext.get("vocab_size", 0), ext.get("eos_token_ids", []))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        async def limited(p):
            if sem is None:
                return await _one(http, args, model, p)
            async with sem:
                return await _one(http, args, model, p)

        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.disable_tqdm or None)

        def done(task: asyncio.Task) -> None:
            if not task.cancelled():
                run.results.append(task.result())
                bar.update(1)

        run.t0 = time.perf_counter()
        tasks = []
        try:
            for p in prompts:
                tasks.append(asyncio.create_task(limited(p)))
                tasks[-1].add_done_callback(done)
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        duration = time.perf_counter() - run.t0
    return report(args, model, run.results, duration)


def report(args, model: str, results: list[RequestResult], duration: float, interrupted: bool = False) -> dict:
    ok = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model, "base_url": args.base_url, "endpoint": args.endpoint, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "output_len": args.output_len, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "interrupted": interrupted,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "ttft": _summary([r.ttft_s for r in ok]), "tpot": _summary(tpots),
        "itl": _summary([x for r in ok for x in r.itl_s]), "e2el": _summary([r.e2e_s for r in ok]),
        "output_tokens_per_request": [r.output_tokens for r in results],
        "spec_decode": spec_summary([r.spec for r in ok if r.spec]),
    }


def format_report(res: dict) -> str:
    title = " Serving Benchmark Result (interrupted: partial) " if res.get("interrupted") else " Serving Benchmark Result "
    lines = [f"{title:=^60}"]

    def row(name, value, fmt="{:.2f}"):
        lines.append(f"{name:<44}{fmt.format(value) if value is not None else 'n/a':>16}")

    row("Successful requests:", res["completed"], "{}")
    row("Failed requests:", res["failed"], "{}")
    row("Benchmark duration (s):", res["duration_s"])
    row("Total input tokens:", res["total_input_tokens"], "{}")
    row("Total generated tokens:", res["total_output_tokens"], "{}")
    row("Request throughput (req/s):", res["request_throughput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency (per streamed chunk)"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize()} {key.upper()} (ms):", res[key][f"{stat}_ms"])
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
    if res["errors"]:
        lines.append("Errors: " + "; ".join(res["errors"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def run_benchmark_sync(args: argparse.Namespace) -> dict:
    """Validate the flags, run the benchmark, return the result dict (what --save-result writes)."""
    _check_args(args)
    return asyncio.run(benchmark(args))


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")


def run_from_args(args: argparse.Namespace) -> int:
    _check_args(args)
    run = _Run()
    try:
        res = asyncio.run(benchmark(args, run))
    except KeyboardInterrupt:
        if not run.t0:
            print("spec-runtime bench: interrupted before any request was sent", file=sys.stderr)
            return 130
        res = report(args, run.model, run.results, time.perf_counter() - run.t0, interrupted=True)
        print(format_report(res))
        saved = f"; saved them to {args.save_result}" if args.save_result else "; --save-result PATH keeps them"
        if args.save_result:
            _save(res, args.save_result)
        print(f"spec-runtime bench: interrupted after {len(run.results)} of {args.num_prompts} requests; "
              f"the results above cover those{saved}", file=sys.stderr)
        return 130
    print(format_report(res))
    if args.save_result:
        _save(res, args.save_result)
        print(f"saved {args.save_result}", file=sys.stderr)
    return 0 if res["failed"] == 0 else 1


def _save(res: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
