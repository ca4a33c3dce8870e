"""`spec-runtime bench`: a load generator for a running `spec-runtime serve`.

Sends --num-prompts streaming requests, either at --request-rate (Poisson arrivals;
inf = all at once) and/or capped at --max-concurrency in flight, with random prompts
(token ids drawn uniformly from the vocabulary the server reports, EOS excluded; with
the chat endpoint, random words) or prompts from a file (JSONL with a "prompt" field,
or one prompt per line). It reports throughput; TTFT, TPOT, ITL and end-to-end latency
(mean, median and --metric-percentiles, for the --percentile-metrics chosen); and a
Speculative Decoding section summed from each response's `usage.spec_decode`.
--save-result writes everything as JSON, with vLLM's result keys (spec_runtime.bench_report);
--plot draws the latency distributions as a PNG. A progress bar counts finished requests on
stderr; Ctrl-C stops the run and reports (and saves) what finished.

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

from spec_runtime.bench_report import (
    check_plot_available,
    format_report,
    parse_metric_percentiles,
    parse_percentile_metrics,
    plot,
    report,
    spec_summary,
)

__all__ = ["add_bench_args", "benchmark", "format_report", "report", "run_benchmark_sync", "run_from_args",
           "spec_summary"]

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
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens (words for chat) of one random prefix every random prompt starts with, before its "
                        "--random-input-len own ones: a shared system prompt, for prefix caching (default: 0)")
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
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el "
                        "(default: %(default)s)")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles to report, e.g. 25,50,75,99 (default: %(default)s)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="draw the TTFT, TPOT, ITL and end-to-end latency distributions as a PNG (needs matplotlib)")


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
        prefix = [rng.choice(_WORDS) for _ in range(args.random_prefix_len)]
        return [" ".join(prefix + [rng.choice(_WORDS) for _ in range(args.random_input_len)])
                for _ in range(args.num_prompts)]
    allowed = [t for t in range(vocab_size) if t not in set(eos_ids)]
    prefix = [rng.choice(allowed) for _ in range(args.random_prefix_len)]
    return [prefix + [rng.choice(allowed) for _ in range(args.random_input_len)] for _ in range(args.num_prompts)]


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


def run_benchmark_sync(args: argparse.Namespace) -> dict:
    """Validate the flags, run the benchmark, return the result dict (what --save-result writes)."""
    _check_args(args)
    return asyncio.run(benchmark(args))


def _check_args(args: argparse.Namespace) -> None:
    args.percentile_metrics_list = parse_percentile_metrics(args.percentile_metrics)
    args.percentiles_list = parse_metric_percentiles(args.metric_percentiles)
    if args.plot:
        check_plot_available()
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.random_prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")


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
        if args.plot:
            plot(res, args.plot)
        print(f"spec-runtime bench: interrupted after {len(run.results)} of {args.num_prompts} requests; "
              f"the results above cover those{saved}", file=sys.stderr)
        return 130
    print(format_report(res))
    if args.save_result:
        _save(res, args.save_result)
        print(f"saved {args.save_result}", file=sys.stderr)
    if args.plot:
        plot(res, args.plot)
        print(f"plotted {args.plot}", file=sys.stderr)
    return 0 if res["failed"] == 0 else 1


def _save(res: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
