"""Load through the HTTP server, and prompts at the context limit.

- 200 concurrent completions of random lengths (SSD, tiny model, CPU) all finish with
  exactly the requested token count; run again streaming with every tenth aborted after
  its first chunk, the other 180 give the same tokens as before; afterwards
  /v1/engine_stats shows no running sequence, no sequence held by the draft and no
  tree-cache entry left.
- Prompts whose length plus max_tokens is exactly the context length, with K in {1, 3, 8}:
  finish_reason "length", greedy output equal to target-only, and the draft never
  crashed (the model runner raises on any position past max_model_len, so a KV overflow
  would kill the process that made it).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from e2e_util import make_config, serve_in_thread
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient

N = 200
MAX_BATCH = 16
MAX_LEN = 128


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    cfg = make_config(target, draft, mode="ssd", k=3).replace(
        sched=SchedulerConfig(max_batch_size=MAX_BATCH, max_model_len=MAX_LEN, spec_policy="always"))
    aclient = AsyncClient(cfg)
    with serve_in_thread(build_app(aclient, served_model_name="tiny")) as url:
        yield url, aclient.client
    aclient.client.close()


def _bodies() -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"model": "tiny", "prompt": rng.integers(3, 384, size=int(rng.integers(2, 40))).tolist(),
             "max_tokens": int(rng.integers(1, 25)), "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            for _ in range(N)]


async def _whole(http: httpx.AsyncClient, url: str, body: dict) -> list[int]:
    r = await http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == body["max_tokens"] == len(choice["token_ids"])
    assert choice["finish_reason"] == "length"
    return choice["token_ids"]


async def _streamed(http: httpx.AsyncClient, url: str, body: dict, abort: bool) -> list[int] | None:
    ids, reasons = [], []
    async with http.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            if abort:
                return None  # leaving the block closes the connection: the server aborts
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            ids += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    assert reasons == ["length"] and len(ids) == body["max_tokens"]
    return ids


async def _run(url: str, bodies: list[dict], stream: bool):
    limits = httpx.Limits(max_connections=N + 10, max_keepalive_connections=N + 10)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        if not stream:
            return await asyncio.gather(*(_whole(http, url, b) for b in bodies))
        # Long requests are the ones aborted, so they are still running when their first chunk arrives.
        return await asyncio.gather(*(_streamed(http, url, b, abort=i % 10 == 0) for i, b in enumerate(bodies)))


def _wait_empty(url: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = httpx.get(url + "/v1/engine_stats", timeout=10).json()
        empty = (st["num_running"], st["num_waiting"], st["draft_num_seqs"], st["draft_num_cache_entries"]) == (0,) * 4
        if empty or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


@pytest.mark.slow
def test_200_concurrent_then_10_percent_aborted(server):
    url, client = server
    bodies = _bodies()
    for i in range(0, N, 10):
        bodies[i]["max_tokens"] = 60  # aborted ones: long enough to be mid-stream when cut
    first = asyncio.run(_run(url, bodies, stream=False))
    second = asyncio.run(_run(url, bodies, stream=True))
    for i, (a, b) in enumerate(zip(first, second)):
        if i % 10:
            assert b == a, f"request {i} changed when others were aborted"
        else:
            assert b is None
    st = _wait_empty(url)
    assert st["num_running"] == 0 and st["num_waiting"] == 0 and st["num_free_slots"] == MAX_BATCH, st
    assert st["draft_alive"] and st["draft_num_seqs"] == 0 and st["draft_num_cache_entries"] == 0, st
    assert st["totals"]["num_cache_hits"] > 0  # the tree cache was exercised
    assert client.launcher.num_draft_restarts == 0


@pytest.mark.parametrize("mode,k", [("sd", 1), ("ssd", 3), pytest.param("ssd", 8, marks=pytest.mark.slow)])
def test_prompts_at_the_context_limit(models, ar_reference, mode, k):
    target, draft = models
    limit = 64
    max_tokens = [1, 2, 3, 4, 8, 9, 13]  # covers K and K + 1 for every K here
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 384, size=limit - n).tolist() for n in max_tokens]
    sched = SchedulerConfig(max_batch_size=len(prompts), max_model_len=limit)
    ref = ar_reference(target, prompts, max_tokens, max_batch_size=len(prompts), max_model_len=limit)
    with Client(make_config(target, draft, mode=mode, k=k).replace(sched=sched)) as client:
        pids = client.launcher.pids()
        ids = [client.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, max_tokens)]
        res = [client._collect(rid) for rid in ids]
        assert [r.finish_reason for r in res] == ["length"] * len(prompts)
        assert [r.token_ids for r in res] == ref
        st = client.engine_stats()
        assert st.draft_alive and client.launcher.pids() == pids and client.launcher.num_draft_restarts == 0
        assert st.totals.num_draft_tokens > 0
