"""The OpenAI-compatible server, live on 127.0.0.1, against the openai SDK and raw HTTP.

One server per module: a tiny random llama target and a perturbed copy as its draft,
SSD mode, K = 3, on the CPU. Random tiny models emit EOS early, so requests that must
produce an exact number of tokens send the `ignore_eos` extension field.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_util import make_config, serve_in_thread, wait_until
from protocol.messages import SamplingParams
from spec_runtime.config import SchedulerConfig
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient

K = 3
MODEL = "tiny-llama"
KEY = "sk-test"
MAX_LEN = 256
MAX_BATCH = 8
BODY_LIMIT = 64 * 1024
EXACT = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_pair):
    target, draft = tiny_pair
    cfg = make_config(target, draft, mode="ssd", k=K).replace(
        sched=SchedulerConfig(max_batch_size=MAX_BATCH, max_model_len=MAX_LEN, spec_policy="always"))
    aclient = AsyncClient(cfg)
    assert aclient.client.engine_stats().draft_alive  # the spec link is up when start-up returns
    submitted = []
    orig_submit = aclient.submit

    def counting_submit(ids, sp):  # records what reaches the engine
        submitted.append((ids, sp))
        return orig_submit(ids, sp)

    aclient.submit = counting_submit
    app = build_app(aclient, served_model_name=MODEL, api_key=KEY, max_body_bytes=BODY_LIMIT)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, client=aclient.client, submitted=submitted,
                              sdk=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0))
    aclient.client.close()


def _post(server, path, body, key=KEY, timeout=60.0):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def _metrics(server) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def _wait_idle(server, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = server.client.engine_stats()
        if st.num_running == 0 and st.num_waiting == 0:
            return st
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {st}")


# ---------------------------------------------------------------------- openai SDK


def test_completion_sdk_counts_and_text(server):
    prompt = "The quick brown fox"
    r = server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=EXACT)
    ids = server.client.encode_prompt(prompt)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert len(c.model_extra["token_ids"]) == 12
    # The same request in-process gives the same tokens and text (greedy is exact).
    ref = server.client.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert c.model_extra["token_ids"] == ref.token_ids and c.text == ref.text
    spec = r.usage.model_extra["spec_decode"]
    assert spec["mode"] == "ssd" and spec["k"] == K
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["num_cache_hits"] + spec["num_cache_misses"] > 0


def test_completion_stream_sdk_include_usage(server):
    prompt = [5, 17, 33, 101, 7]
    whole = server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body=EXACT)
    chunks = list(server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=EXACT))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert text == whole.choices[0].text and ids == whole.choices[0].model_extra["token_ids"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 20 == len(ids) and usage.prompt_tokens == 5
    assert usage.model_extra["spec_decode"]["num_draft_tokens"] > 0
    # Without include_usage, no usage chunk.
    plain = list(server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True, temperature=0))
    assert all(c.choices and c.usage is None for c in plain)


def test_chat_sdk_stream_and_not(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    n_prompt = len(server.client.encode_chat(messages))
    r = server.sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 10)
    chunks = list(server.sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == n_prompt


def test_models_health_metrics_parse(server):
    models = server.sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = _metrics(server)
    for name in ("spec_runtime:spec_decode_num_drafts_total", "spec_runtime:spec_decode_num_draft_tokens_total",
                 "spec_runtime:spec_decode_num_accepted_tokens_total", "spec_runtime:spec_decode_cache_hits_total",
                 "spec_runtime:spec_decode_cache_misses_total", "spec_runtime:prompt_tokens_total",
                 "spec_runtime:generation_tokens_total", "spec_runtime:num_requests_running",
                 "spec_runtime:num_requests_waiting", "spec_runtime:time_to_first_token_seconds_count",
                 "spec_runtime:inter_token_latency_seconds_count", "spec_runtime:e2e_request_latency_seconds_count",
                 "spec_runtime:draft_restarts_total", "spec_runtime:draft_alive"):
        assert (name, ()) in m, name
    assert m[("spec_runtime:draft_restarts_total", ())] == 0 and m[("spec_runtime:draft_alive", ())] == 1
    for i in range(K):
        assert ("spec_runtime:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)) in m


# ---------------------------------------------------------------------- errors


BAD = [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"max_tokens": MAX_LEN}, "max_tokens"),  # prompt + max_tokens over the context
    ("/v1/completions", {"temperature": -0.1}, "temperature"),
    ("/v1/completions", {"top_p": 0.0}, "top_p"),
    ("/v1/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": "gpt-4"}, "model"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logit_bias": {"5": 101.0}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"guided_json": {"type": "no such type"}}, "guided_json"),
    ("/v1/completions", {"no_such_field": 1}, "no_such_field"),
    ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
]


@pytest.mark.parametrize("path,override,param", BAD)
def test_bad_request_is_400_with_openai_error_and_never_reaches_engine(server, path, override, param):
    body = {"model": MODEL, "max_tokens": 4}
    body.update({"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(override)
    before = len(server.submitted)
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert len(server.submitted) == before


def test_ssd_greedy_with_processors_equals_reference(server):
    """Penalties, logit bias and min_tokens with the tree cache in the path: greedy output
    is a plain reference loop's (transformers' logits, textbook processors, argmax)."""
    from test_e2e_params import reference_greedy

    prompt = [5, 17, 33, 101, 7, 250, 12]
    kw = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={60: 2.0},
              min_tokens=3)
    r = server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body=dict(EXACT, **{k: v for k, v in kw.items() if k != "logit_bias"}),
                                      logit_bias={"60": 2.0})
    ref = reference_greedy(server.client.config.target.path, prompt,
                           SamplingParams(max_tokens=20, ignore_eos=True, **kw))
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.usage.model_extra["spec_decode"]["num_accepted_tokens"] > 0


def test_sdk_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="context length"):
        server.sdk.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_LEN)


def test_oversized_and_malformed_bodies(server):
    before = len(server.submitted)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 2})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert len(server.submitted) == before


def test_api_key_enforced(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


# ---------------------------------------------------------------------- abort


def test_disconnect_aborts_and_frees_target_and_draft_state(server):
    aborts = ("spec_runtime:request_success_total", (("finished_reason", "abort"),))
    before = _metrics(server).get(aborts, 0.0)
    body = {"model": MODEL, "prompt": [9, 8, 7, 6], "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True}
    for _ in range(MAX_BATCH):  # one per draft slot: a leak of each would leave the draft no slot
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            first = next(r.iter_lines())
            assert first.startswith("data:")
        # Non-streaming: the server notices the disconnect while waiting for the whole response.
        with pytest.raises(httpx.ReadTimeout):
            _post(server, "/v1/completions", dict(body, stream=False), timeout=0.3)
    st = _wait_idle(server)
    assert st.num_free_slots == MAX_BATCH
    assert wait_until(lambda: _metrics(server).get(aborts, 0.0) >= before + 2 * MAX_BATCH, 60, 0.1), \
        "aborted requests were not all counted"
    # The draft released every aborted sequence: a full batch now gets speculation in every round
    # (a draft with no free slot answers with an error and the target decodes without it).
    rs = asyncio.run(_concurrent(server, [{"prompt": [3 + i, 50, 60], "max_tokens": 24} for i in range(MAX_BATCH)]))
    for r in rs:
        spec = r.usage.model_extra["spec_decode"]
        assert r.usage.completion_tokens == 24
        assert spec["num_ar_fallback_rounds"] == 0 and spec["num_drafts"] > 0, spec


# ---------------------------------------------------------------------- load and metrics


async def _concurrent(server, bodies: list[dict]):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as sdk:
        return await asyncio.gather(*(sdk.completions.create(model=MODEL, temperature=0, extra_body=EXACT, **b)
                                      for b in bodies))


@pytest.mark.slow
def test_100_concurrent_requests_finish_with_requested_counts(server):
    bodies = [{"prompt": [3 + i % 50, 4 + i % 7, 5], "max_tokens": 1 + i % 13} for i in range(100)]
    rs = asyncio.run(_concurrent(server, bodies))
    for b, r in zip(bodies, rs):
        assert r.usage.completion_tokens == b["max_tokens"] == len(r.choices[0].model_extra["token_ids"])
        assert r.choices[0].finish_reason == "length"
    _wait_idle(server)


def test_metrics_equal_sum_over_requests(server):
    _wait_idle(server)
    time.sleep(0.2)  # let any earlier request's final output reach the metrics
    m0, e0 = _metrics(server), server.client.engine_stats().totals
    bodies = [{"prompt": [10 + i, 20, 30, 40], "max_tokens": 8 + 3 * i} for i in range(12)]
    rs = asyncio.run(_concurrent(server, bodies))
    m1, e1 = _metrics(server), server.client.engine_stats().totals

    def delta(name, labels=()):
        return m1.get((f"spec_runtime:{name}", labels), 0.0) - m0.get((f"spec_runtime:{name}", labels), 0.0)

    specs = [r.usage.model_extra["spec_decode"] for r in rs]
    total = {k: sum(s[k] for s in specs) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                     "num_cache_hits", "num_cache_misses")}
    assert delta("spec_decode_num_drafts_total") == total["num_drafts"]
    assert delta("spec_decode_num_draft_tokens_total") == total["num_draft_tokens"] \
        == e1.num_draft_tokens - e0.num_draft_tokens
    assert delta("spec_decode_num_accepted_tokens_total") == total["num_accepted_tokens"] \
        == e1.num_accepted_tokens - e0.num_accepted_tokens
    assert delta("spec_decode_cache_hits_total") == total["num_cache_hits"] == e1.num_cache_hits - e0.num_cache_hits
    assert delta("spec_decode_cache_misses_total") == total["num_cache_misses"]
    assert delta("generation_tokens_total") == sum(r.usage.completion_tokens for r in rs) \
        == sum(b["max_tokens"] for b in bodies)
    assert delta("prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs) == 4 * len(bodies)
    assert delta("request_success_total", (("finished_reason", "length"),)) == len(bodies)
    assert delta("e2e_request_latency_seconds_count") == len(bodies)
    for i in range(K):
        pos = (("position", str(i)),)
        acc = delta("spec_decode_num_accepted_tokens_per_pos_total", pos)
        dra = delta("spec_decode_draft_tokens_per_pos_total", pos)
        assert acc == sum(s["accepted_per_position"][i] for s in specs) and acc <= dra
    assert 0 < total["num_accepted_tokens"] <= total["num_draft_tokens"] <= K * total["num_drafts"]
    mean_len = 1 + delta("spec_decode_num_accepted_tokens_total") / delta("spec_decode_num_drafts_total")
    assert 1.0 <= mean_len <= K + 1
    for s in specs:
        assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-4)
        assert 1.0 <= s["mean_acceptance_length"] <= K + 1


def test_engine_stats_endpoint(server):
    r = httpx.get(server.url + "/v1/engine_stats", headers={"Authorization": f"Bearer {KEY}"})
    body = r.json()
    assert r.status_code == 200 and body["mode"] == "ssd" and body["num_running"] == 0
    assert body["totals"]["num_accepted_tokens"] <= body["totals"]["num_draft_tokens"]
    assert json.dumps(body)


def test_draft_restart_counter_follows_the_launcher():
    from prometheus_client.parser import text_string_to_metric_families

    from spec_runtime.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", k=2)

    def restarts(n):
        text = metrics.render(None, draft_restarts=n).decode()
        fam = next(f for f in text_string_to_metric_families(text) if f.name == "spec_runtime:draft_restarts")
        return next(s.value for s in fam.samples if s.name.endswith("_total"))

    assert restarts(0) == 0
    assert restarts(2) == 2
    assert restarts(2) == 2  # counted once
    assert restarts(3) == 3
