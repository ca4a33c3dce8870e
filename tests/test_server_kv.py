"""The server over a small paged KV pool: a request the pool cannot hold gets a 400, the
prefix cache shows in `usage.prompt_tokens_details.cached_tokens` and in /metrics."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from conftest import save_tiny_model
from e2e_util import make_config, serve_in_thread
from http_util import RawConnection
from spec_runtime.config import SchedulerConfig
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient

MODEL = "tiny"
BS, NUM_BLOCKS, MAX_LEN = 4, 16, 128  # the pool holds 64 tokens, the context 128


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("kv") / "t", "llama")
    cfg = make_config(target, mode="ar").replace(
        sched=SchedulerConfig(max_batch_size=4, max_model_len=MAX_LEN, block_size=BS, num_kv_blocks=NUM_BLOCKS))
    aclient = AsyncClient(cfg)
    app = build_app(aclient, served_model_name=MODEL)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, client=aclient.client)
    aclient.client.close()


def _body(prompt, max_tokens=4):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_a_prompt_longer_than_the_pool_gets_a_400(server):
    conn = RawConnection(server.url)
    try:
        status, _, body = conn.post_json("/v1/completions", _body(list(range(3, 73))))  # 70 tokens < max_model_len
        assert status == 400, body
        assert b"KV cache" in body and b"64 rows" in body
        status, _, body = conn.post_json("/v1/completions", _body(list(range(3, 23))))  # the same connection serves on
        assert status == 200, body
    finally:
        conn.close()
    assert server.client.engine_stats().num_waiting == 0


def test_cached_prompt_tokens_are_reported_in_usage_and_metrics(server):
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks before the last token
    first = httpx.post(server.url + "/v1/completions", json=_body(prompt), timeout=60).json()
    second = httpx.post(server.url + "/v1/completions", json=_body(prompt), timeout=60).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 28}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    values = {line.split(" ")[0].split("{")[0]: float(line.split(" ")[-1])
              for line in metrics.splitlines() if line and not line.startswith("#")}
    assert values["spec_runtime:prefix_cache_hits_total"] >= 28
    assert values["spec_runtime:prefix_cache_queries_total"] >= 60
    assert "spec_runtime:num_preemptions_total" in values


def test_n_choices_share_the_prompt_prefill(server):
    prompt = list(range(200, 214))  # 14 tokens: 3 full blocks before the last token; 3 x 4 blocks fit the pool
    before = server.client.engine_stats().prefix_cache_hits
    r = httpx.post(server.url + "/v1/completions", json={**_body(prompt), "n": 3}, timeout=60).json()
    assert len(r["choices"]) == 3 and len({c["text"] for c in r["choices"]}) == 1
    # The first choice prefills the prompt; the other two reuse its full blocks, whether they
    # reach the target in the same step (they wait one: test_paged_serving) or after it.
    assert server.client.engine_stats().prefix_cache_hits - before == 2 * 12
