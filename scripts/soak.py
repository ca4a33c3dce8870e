"""Soak test: mixed traffic through the HTTP server (or the Client) while the draft is
SIGKILLed at random.

    python scripts/soak.py --minutes 2 --mode ssd --kill-every-s 10

Every greedy output is compared token for token with a target-only (AR) reference of the
same prompt; sampled requests must finish with exactly their max_tokens; a few requests
are aborted after their first chunk (over HTTP: the client closes the stream; with
--via client: Client.abort) and must end with finish_reason "abort". A request that
raises, times out or ends short is *lost*. With --via http (the default) the requests go
through the OpenAI server (in this process, on 127.0.0.1), and at the end its /metrics
must count each request exactly once, aborted ones included: request_success_total summed
over finish reasons equals the requests sent, "length" covers every request that ran to
the end, and nothing is counted as "error" or "unknown". Prints one JSON report and exits
1 if any request was lost, any greedy output differs or the metrics do not add up.

Without --target, tiny random llama models (a target and a perturbed copy as the draft)
are built in a temporary directory (scripts/tiny_models.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from protocol.messages import SamplingParams  # noqa: E402
from spec_runtime.client import Client  # noqa: E402
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from tiny_models import save_tiny_pair  # noqa: E402  (this script's folder is on sys.path)

logger = logging.getLogger("soak")


def make_pool(rng: random.Random, vocab: int, n: int, max_len: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs of mixed lengths, some close to the context limit."""
    pool = []
    for i in range(n):
        max_tokens = rng.choice([1, 2, 7, 16, 33, 64])
        plen = max_len - max_tokens if i % 8 == 0 else rng.randint(2, 60)  # every 8th fills the context
        pool.append(([rng.randrange(3, vocab) for _ in range(plen)], max_tokens))
    return pool


def run_one(client: Client, kind: str, prompt: list[int], max_tokens: int, seed: int) -> tuple[list[int], str | None]:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kind == "sampled":
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.9, seed=seed)
    rid = client.submit(prompt, sp)
    ids, reason = [], None
    for out in client.stream_outputs(rid, timeout_s=60):
        ids += out.new_token_ids
        reason = out.finish_reason
        if kind == "abort" and not out.finished:
            client.abort(rid)
            kind = "aborting"
    return ids, reason


def serve_in_thread(client: Client):
    """The OpenAI server over `client` on a free loopback port, in a thread: (url, stop)."""
    import uvicorn

    from spec_runtime.server.app import build_app
    from spec_runtime.server.async_client import AsyncClient

    app = build_app(AsyncClient(client=client), served_model_name="soak")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def run_one_http(http, kind: str, prompt: list[int], max_tokens: int, seed: int,
                 sent: list) -> tuple[list[int], str | None]:
    """One streamed /v1/completions request; an "abort" closes the stream after its first
    chunk (the server then aborts it). `sent` gets one entry once the server accepted it."""
    body = {"model": "soak", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "temperature": 0.0}
    if kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=seed)
    ids, reason = [], None
    with http.stream("POST", "/v1/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        sent.append(1)
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error'].get('message')}")
            for choice in obj.get("choices") or []:
                ids += choice.get("token_ids") or []
                reason = choice.get("finish_reason") or reason
            if kind == "abort" and ids and reason is None:
                return ids, "abort"  # leaving the `with` closes the connection
    return ids, reason


def success_counts(metrics_text: str) -> dict[str, int]:
    """spec_runtime:request_success_total of a /metrics scrape, by finish reason."""
    from prometheus_client.parser import text_string_to_metric_families

    by_reason: dict[str, int] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for sample in fam.samples:
            if sample.name == "spec_runtime:request_success_total":
                reason = sample.labels["finished_reason"]
                by_reason[reason] = by_reason.get(reason, 0) + int(sample.value)
    return by_reason


def metrics_problems(by_reason: dict[str, int], num_sent: int, num_ran_to_end: int, num_aborts: int) -> list[str]:
    """Why the counts by finish reason do not match the requests sent (each counted exactly
    once, aborts included); [] when they do."""
    problems = []
    counted = sum(by_reason.values())
    if counted != num_sent:
        problems.append(f"request_success_total counts {counted} requests, {num_sent} were sent")
    if set(by_reason) - {"length", "abort"}:
        problems.append(f"finish reasons other than length and abort: {by_reason}")
    if by_reason.get("length", 0) < num_ran_to_end:
        problems.append(f"{by_reason.get('length', 0)} counted as length, {num_ran_to_end} ran to their end")
    if by_reason.get("abort", 0) > num_aborts:
        problems.append(f"{by_reason.get('abort', 0)} counted as abort, more than the {num_aborts} aborted")
    return problems


def metrics_check(url: str, num_sent: int, num_ran_to_end: int, num_aborts: int, timeout_s: float = 30.0) -> dict:
    """The server's counts against the requests sent. Waits up to timeout_s for the aborted
    requests' counts (they land when the engine confirms the abort)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        by_reason = success_counts(httpx.get(url + "/metrics", timeout=30).text)
        if sum(by_reason.values()) >= num_sent or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {"sent": num_sent, "counted": sum(by_reason.values()), "by_finish_reason": by_reason,
            "problems": metrics_problems(by_reason, num_sent, num_ran_to_end, num_aborts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--target", default="", help="target model dir (default: build a tiny one)")
    ap.add_argument("--draft", default="", help="draft model dir (default: a perturbed copy of the tiny target)")
    ap.add_argument("--mode", choices=["sd", "ssd"], default="ssd")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--kill-every-s", type=float, default=10.0, help="mean seconds between draft SIGKILLs (0: never)")
    ap.add_argument("--concurrency", type=int, default=8, help="client threads sending requests")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=192)
    ap.add_argument("--pool", type=int, default=48, help="distinct greedy prompts (each has an AR reference)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--via", choices=["http", "client"], default="http",
                    help="send the requests through the OpenAI server and check its metrics (http), or through "
                         "the Python Client (client)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")

    tmp = tempfile.TemporaryDirectory(prefix="soak-")
    target, draft = args.target, args.draft
    if not target:
        target, draft = save_tiny_pair(tmp.name)
    draft = draft or target
    sched = SchedulerConfig(max_batch_size=args.max_batch_size, max_model_len=args.max_model_len)

    def config(mode: str) -> RuntimeConfig:
        return RuntimeConfig(target=ModelConfig(path=target), draft=ModelConfig(path=draft),
                             spec=SpeculativeConfig(mode=mode, k=args.k, draft_timeout_s=1.0), sched=sched,
                             startup_timeout_s=240.0)

    rng = random.Random(args.seed)
    t_ref = time.monotonic()
    with Client(config("ar")) as ar:
        pool = make_pool(rng, ar.ready.vocab_size, args.pool, ar.ready.max_model_len)
        rids = [ar.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in pool]
        reference = [ar._collect(r).token_ids for r in rids]
    logger.warning("AR reference of %d prompts in %.1f s", len(pool), time.monotonic() - t_ref)

    counts = {"greedy": 0, "sampled": 0, "abort": 0}
    lost, mismatches, errors = [], [], []
    lock = threading.Lock()
    stop = threading.Event()
    kills = []
    sent: list = []  # one entry per request the server accepted (--via http)
    tally = {"ran_to_end": 0, "aborts": 0}  # greedy/sampled requests that finished whole; abort attempts

    with Client(config(args.mode)) as client:
        url, stop_server = serve_in_thread(client) if args.via == "http" else (None, lambda: None)

        def worker(wid: int) -> None:
            import httpx

            wrng = random.Random(args.seed * 1000 + wid)
            http = httpx.Client(base_url=url) if url else None
            while not stop.is_set():
                i = wrng.randrange(len(pool))
                prompt, max_tokens = pool[i]
                kind = wrng.choices(["greedy", "sampled", "abort"], weights=[7, 2, 1])[0]
                try:
                    if http is not None:
                        ids, reason = run_one_http(http, kind, prompt, max_tokens, wrng.getrandbits(32), sent)
                    else:
                        ids, reason = run_one(client, kind, prompt, max_tokens, seed=wrng.getrandbits(32))
                except Exception as e:  # noqa: BLE001 - every failure is a lost request
                    with lock:
                        lost.append((kind, i))
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                with lock:
                    counts[kind] += 1
                    tally["aborts"] += kind == "abort"
                    tally["ran_to_end"] += kind != "abort" and reason == "length" and len(ids) == max_tokens
                    if kind == "abort":
                        ok = reason == "abort" or (reason == "length" and len(ids) == max_tokens)
                    else:
                        ok = reason == "length" and len(ids) == max_tokens
                    if not ok:
                        lost.append((kind, i))
                        errors.append(f"{kind} #{i}: {len(ids)}/{max_tokens} tokens, finish_reason {reason}")
                    elif kind == "greedy" and ids != reference[i]:
                        mismatches.append(i)

        def killer() -> None:
            krng = random.Random(args.seed + 1)
            while not stop.wait(krng.uniform(0.5, 1.5) * args.kill_every_s):
                if client.launcher.dead_child() is None:
                    pid = client.launcher.pids()["draft"]
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(args.concurrency)]
        if args.kill_every_s > 0:
            threads.append(threading.Thread(target=killer, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(args.minutes * 60)
        stop.set()
        for t in threads:
            t.join(120)
        elapsed = time.monotonic() - t0
        # Let a restart in progress finish, then check that nothing is left anywhere.
        deadline = time.monotonic() + 60
        while client.launcher.dead_child() is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        metrics = None
        if url:
            metrics = metrics_check(url, len(sent), tally["ran_to_end"], tally["aborts"])
            stop_server()
        st = client.engine_stats()
        report = {
            "mode": args.mode, "k": args.k, "minutes": round(elapsed / 60, 2), "target": target, "draft": draft,
            "requests": counts, "lost": len(lost), "mismatches": len(mismatches),
            "draft_kills": len(kills), "draft_restarts": client.launcher.num_draft_restarts,
            "stuck_threads": sum(t.is_alive() for t in threads),
            "final": {"num_running": st.num_running, "num_waiting": st.num_waiting, "draft_alive": st.draft_alive,
                      "draft_num_seqs": st.draft_num_seqs, "draft_num_cache_entries": st.draft_num_cache_entries},
            "totals": {"generated_tokens": st.totals.num_generated_tokens, "draft_tokens": st.totals.num_draft_tokens,
                       "accepted_tokens": st.totals.num_accepted_tokens, "cache_hits": st.totals.num_cache_hits,
                       "ar_fallback_rounds": st.totals.num_ar_fallback_rounds},
            "errors": errors[:10], "mismatched_prompts": sorted(set(mismatches))[:10],
            "via": args.via, "metrics": metrics,
        }
    print(json.dumps(report, indent=2))
    if metrics is not None and metrics["problems"]:
        for problem in metrics["problems"]:
            print(f"soak: METRICS DO NOT MATCH THE REQUESTS SENT: {problem}", file=sys.stderr)
    tmp.cleanup()
    clean = st.num_running == 0 and st.num_waiting == 0 and report["stuck_threads"] == 0 and (
        not st.draft_alive or (st.draft_num_seqs == 0 and st.draft_num_cache_entries == 0))
    metrics_ok = metrics is None or not metrics["problems"]
    return 0 if not lost and not mismatches and clean and metrics_ok else 1


if __name__ == "__main__":
    sys.exit(main())
