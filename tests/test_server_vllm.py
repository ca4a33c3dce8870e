"""vLLM compatibility of the live server: /v1/models/{model}, /tokenize, /detokenize,
/version, /ping; /metrics with `--metrics-prefix vllm` read by vLLM's own bench parser and
by vLLM's Grafana dashboard queries; generation-config defaults.

One server for the module: a tiny random llama target and a perturbed copy as its draft,
SD mode, K = 3, on the CPU, metrics named `vllm:...`.
"""

from __future__ import annotations

import contextlib
import re
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import save_tiny_model
from e2e_util import make_config, perturbed_copy, serve_in_thread
from protocol.messages import EngineStats, RequestStats
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient
from spec_runtime.server.info_routes import runtime_version
from spec_runtime.server.metrics import COUNTERS, ENGINE_COUNTERS, GAUGES, HISTOGRAMS, engine_gauges, length_buckets

K = 3
MODEL = "tiny"
KEY = "sk-vllm"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEFAULTS = {"top_k": 7, "min_p": 0.05}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    target = save_tiny_model(root / "target", "llama")
    draft = perturbed_copy(target, str(root / "draft"), noise=0.2)
    aclient = AsyncClient(make_config(target, draft, mode="sd", k=K))
    submitted = []
    orig_submit = aclient.submit

    def recording_submit(ids, sp):
        submitted.append(sp)
        return orig_submit(ids, sp)

    aclient.submit = recording_submit
    app = build_app(aclient, served_model_name=MODEL, api_key=KEY, metrics_prefix="vllm",
                    generation_defaults=DEFAULTS)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, client=aclient.client, submitted=submitted)
    aclient.client.close()


def _complete(server, n_tokens=6, **kw):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            **kw}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- endpoints


def test_model_card_by_id(server):
    r = httpx.get(f"{server.url}/v1/models/{MODEL}", headers=AUTH)
    assert r.status_code == 200
    card = r.json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 256
    r = httpx.get(f"{server.url}/v1/models/gpt-4", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 401


def test_tokenize_and_detokenize(server):
    tok = server.client.tokenizer
    text = "Hello, world! Paris is the capital of France."
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and body["token_strs"] is None
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True,
                                                   "add_special_tokens": False})
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200 and r.json()["tokens"] == server.client.encode_chat(messages)
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(body["tokens"])}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "nope": 1}, "nope"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "\ud800"}, None),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
])
def test_tokenize_refuses_bad_bodies_with_openai_errors(server, path, body, param):
    import json

    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err


def test_version_and_ping(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": runtime_version()} and r.json()["version"] != "unknown"
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200


def test_generation_defaults_apply_where_the_request_is_silent(server):
    _complete(server)
    assert (server.submitted[-1].top_k, server.submitted[-1].min_p) == (7, 0.05)
    _complete(server, top_k=3, min_p=None)  # given: kept; null: the default
    assert (server.submitted[-1].top_k, server.submitted[-1].min_p) == (3, 0.05)


# ---------------------------------------------------------------- metrics


def _scrape(server) -> tuple[str, dict]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def test_every_metric_is_named_as_vllm_names_it(server):
    _complete(server)
    text, samples = _scrape(server)
    names = {name for name, _ in samples}
    assert "_created" not in text and "spec_runtime:" not in text
    for _, name, *_ in COUNTERS:
        assert f"vllm:{name}_total" in names, name
    for _, name, *_ in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert f"vllm:{name}{suffix}" in names, name
    for _, name, _ in GAUGES:
        assert f"vllm:{name}" in names, name
    for _, _, name, _ in ENGINE_COUNTERS:  # the engine's step and tree counters, from the first scrape
        assert f"vllm:{name}_total" in names, name
    labels = dict(next(lbl for (n, lbl) in samples if n == "vllm:kv_cache_usage_perc"))
    assert labels == {"model_name": MODEL}
    assert samples[("vllm:num_preemptions_total", (("model_name", MODEL),))] == 0


def _value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def test_request_histograms_count_each_finished_request(server):
    _, before = _scrape(server)
    usages = [_complete(server, n_tokens=5 + i)["usage"] for i in range(3)]
    _, after = _scrape(server)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert delta(f"vllm:{name}_count") == 3, name
    assert delta("vllm:request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:request_generation_tokens_sum") == 5 + 6 + 7
    assert delta("vllm:request_decode_time_seconds_sum") > 0
    assert delta("vllm:request_generation_tokens_bucket", le="5.0") == 1  # 5 tokens; 6 and 7 go above
    assert delta("vllm:request_success_total", finished_reason="length") == 3


def test_kv_cache_usage_is_the_share_of_blocks_in_use():
    stats = EngineStats(num_running=3, num_waiting=2, num_free_slots=1, draft_alive=True, mode="sd",
                        totals=RequestStats(), num_kv_blocks=40, num_free_kv_blocks=10)
    assert dict(engine_gauges(stats))["kv_cache_usage"] == 0.75
    assert length_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)


# vLLM's parser of its spec-decode counters, as `vllm bench serve` runs it on /metrics:
# the body of `fetch_spec_decode_metrics` in vllm/benchmarks/serve.py (vllm-project/vllm,
# commit 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1, Apache-2.0), copied as it is except
# that it takes the scraped text instead of fetching it with aiohttp.
def vllm_fetch_spec_decode_metrics(text: str):
    num_drafts = 0
    num_draft_tokens = 0
    num_accepted_tokens = 0
    accepted_per_pos: dict[int, int] = {}
    found_spec_decode = False

    for line in text.split("\n"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue

        if line.startswith("vllm:spec_decode"):
            # Extract metric name (before labels) to avoid matching
            # substrings inside label values.
            parts = line.split(None, 1)
            metric_name = parts[0].split("{")[0]
            if not metric_name.endswith("_total"):
                continue
            found_spec_decode = True
            with contextlib.suppress(ValueError):
                if "num_drafts" in metric_name:
                    num_drafts += int(float(parts[-1]))
                elif "num_draft_tokens" in metric_name:
                    num_draft_tokens += int(float(parts[-1]))
                elif "num_accepted_tokens_per_pos" in metric_name:
                    pos_label = 'position="'
                    if pos_label in line:
                        start = line.index(pos_label) + len(pos_label)
                        end = line.index('"', start)
                        pos = int(line[start:end])
                        val = int(float(parts[-1]))
                        accepted_per_pos[pos] = accepted_per_pos.get(pos, 0) + val
                elif "num_accepted_tokens" in metric_name:
                    num_accepted_tokens += int(float(parts[-1]))

    if not found_spec_decode:
        return None

    return SimpleNamespace(num_drafts=num_drafts, num_draft_tokens=num_draft_tokens,
                           num_accepted_tokens=num_accepted_tokens, accepted_per_pos=accepted_per_pos)


def test_vllm_bench_serve_reads_the_spec_decode_counters(server):
    before = vllm_fetch_spec_decode_metrics(_scrape(server)[0])
    specs = [_complete(server, n_tokens=12, prompt=p)["usage"]["spec_decode"]
             for p in ("one two three", "Hello there", "def add(a, b):")]
    after = vllm_fetch_spec_decode_metrics(_scrape(server)[0])
    assert before is not None and after is not None
    assert after.num_drafts - before.num_drafts == sum(s["num_drafts"] for s in specs) > 0
    assert after.num_draft_tokens - before.num_draft_tokens == sum(s["num_draft_tokens"] for s in specs)
    assert after.num_accepted_tokens - before.num_accepted_tokens == sum(s["num_accepted_tokens"] for s in specs)
    for pos in range(K):
        got = after.accepted_per_pos.get(pos, 0) - before.accepted_per_pos.get(pos, 0)
        assert got == sum(s["accepted_per_position"][pos] for s in specs), pos


# The queries of vLLM's Grafana dashboard, examples/observability/prometheus_grafana/grafana.json
# (vllm-project/vllm, commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9, Apache-2.0), as they appear
# there; of each panel's histogram_quantile targets (P99, P95, P90, P50) only the P99 one, since
# the others differ in the quantile only.
GRAFANA_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]


def test_vllms_grafana_dashboard_finds_every_series_it_queries(server):
    _complete(server)
    _, samples = _scrape(server)
    for query in GRAFANA_QUERIES:
        for name, selector in re.findall(r"(vllm:[A-Za-z0-9_:]+)\{([^}]*)\}", query):
            want = dict(re.findall(r'(\w+)="([^"]*)"', selector.replace("$model_name", MODEL)))
            series = [dict(lbl) for (n, lbl) in samples if n == name]
            matching = [s for s in series if all(s.get(k) == v for k, v in want.items())]
            assert matching, (name, query)
            for group in re.findall(r"by\s*\((\w+)\)", query):  # sum by(le), sum by(finished_reason)
                assert all(group in s for s in matching), (name, group)
