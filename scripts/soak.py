"""Soak test: mixed traffic through the Client while the draft is SIGKILLed at random.

    python scripts/soak.py --minutes 2 --mode ssd --kill-every-s 10

Every greedy output is compared token for token with a target-only (AR) reference of the
same prompt; sampled requests must finish with exactly their max_tokens; a few requests
are aborted after their first chunk and must end with finish_reason "abort". A request
that raises, times out or ends short is *lost*. Prints one JSON report and exits 1 if
any request was lost or any greedy output differs, 0 otherwise.

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

    with Client(config(args.mode)) as client:
        def worker(wid: int) -> None:
            wrng = random.Random(args.seed * 1000 + wid)
            while not stop.is_set():
                i = wrng.randrange(len(pool))
                prompt, max_tokens = pool[i]
                kind = wrng.choices(["greedy", "sampled", "abort"], weights=[7, 2, 1])[0]
                try:
                    ids, reason = run_one(client, kind, prompt, max_tokens, seed=wrng.getrandbits(32))
                except Exception as e:  # noqa: BLE001 - every failure is a lost request
                    with lock:
                        lost.append((kind, i))
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                with lock:
                    counts[kind] += 1
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
        }
    print(json.dumps(report, indent=2))
    tmp.cleanup()
    clean = st.num_running == 0 and st.num_waiting == 0 and report["stuck_threads"] == 0 and (
        not st.draft_alive or (st.draft_num_seqs == 0 and st.draft_num_cache_entries == 0))
    return 0 if not lost and not mismatches and clean else 1


if __name__ == "__main__":
    sys.exit(main())
