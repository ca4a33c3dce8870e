"""Prompt logprobs: the engine's PromptLogprobs, completions' echo with logprobs, and vLLM's
prompt_logprobs on both endpoints, against a direct transformers forward of the target.

One SD runtime (tiny random llama target, perturbed draft, K = 3, CPU) served over HTTP;
its in-process client runs the engine-level checks.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from e2e_util import make_config, random_prompts, record_submits, serve_in_thread
from protocol.messages import SamplingParams
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient
from target_proc.prompt_logprobs import prompt_logprobs, split_prefill_logits

MODEL = "tiny"


@pytest.fixture(scope="module")
def rt(tiny_pair):
    target, draft = tiny_pair
    aclient = AsyncClient(make_config(target, draft, mode="sd", k=3, max_batch_size=8))
    submitted = record_submits(aclient)
    with serve_in_thread(build_app(aclient, served_model_name=MODEL)) as url:
        yield SimpleNamespace(url=url, client=aclient.client, target=target, submitted=submitted)
    aclient.client.close()


@functools.lru_cache(maxsize=1)
def _hf_model(target: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)


def log_softmax(target: str, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position of ids, [len(ids), V]."""
    with torch.inference_mode():
        return torch.log_softmax(_hf_model(target)(torch.tensor([ids])).logits[0].float(), -1)


def post(rt, path: str, body: dict) -> httpx.Response:
    return httpx.post(rt.url + path, json={"model": MODEL, **body}, timeout=120)


def test_split_and_compute_on_synthetic_logits():
    torch.manual_seed(0)
    logits = torch.randn(1 + 5 + 1, 11)  # a "last" request, a 5-token "all" one, a "last" one
    last, rows = split_prefill_logits(logits, [1, 5, 1])
    torch.testing.assert_close(last, logits[[0, 5, 6]])
    assert [r.shape[0] for r in rows] == [0, 4, 0]
    prompt = [3, 1, 4, 1, 5]
    plp = prompt_logprobs(rows[1], prompt, num_top=3)
    lsm = torch.log_softmax(logits[1:5], -1)
    torch.testing.assert_close(torch.tensor(plp.logprobs), lsm[torch.arange(4), torch.tensor(prompt[1:])])
    assert plp.ranks == [int((lsm[i] > lsm[i, t]).sum()) + 1 for i, t in enumerate(prompt[1:])]
    assert plp.top_token_ids == lsm.topk(3).indices.tolist()
    assert prompt_logprobs(logits[:0], [7], num_top=2).logprobs == []
    with pytest.raises(ValueError, match="logits rows"):
        prompt_logprobs(rows[1], prompt[:3], num_top=0)


def test_engine_prompt_logprobs_are_the_targets_and_generation_is_unchanged(rt, ar_reference):
    prompts = random_prompts(384, lengths=(9, 14, 1), seed=21)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    asks = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=n) for n in (3, 0, 2)]
    # Mixed in one prefill: requests with and without prompt logprobs.
    rids = [rt.client.submit(p, sp) for p, sp in zip(prompts, asks)] + [rt.client.submit(p, plain) for p in prompts]
    results = [rt.client._collect(rid) for rid in rids]
    with_lp, without = results[:3], results[3:]
    ref = ar_reference(rt.target, prompts, 10)
    for p, sp, got, base, want in zip(prompts, asks, with_lp, without, ref):
        assert got.token_ids == base.token_ids == want  # exact: greedy output as AR's
        assert base.prompt_logprobs is None
        plp = got.prompt_logprobs
        assert len(plp.logprobs) == len(plp.ranks) == len(p) - 1
        if len(p) == 1:
            continue
        lsm = log_softmax(rt.target, p)[:-1]  # row i predicts p[i + 1]
        targets = torch.tensor(p[1:])
        torch.testing.assert_close(torch.tensor(plp.logprobs), lsm[torch.arange(len(p) - 1), targets],
                                   atol=1e-4, rtol=0)
        ranks = [int((lsm[i] > lsm[i, t] + 1e-5).sum()) + 1 for i, t in enumerate(p[1:])]
        assert plp.ranks == ranks
        if sp.prompt_logprobs:
            top_lp, top_ids = lsm.topk(sp.prompt_logprobs)
            assert plp.top_token_ids == top_ids.tolist()
            torch.testing.assert_close(torch.tensor(plp.top_logprobs), top_lp, atol=1e-4, rtol=0)
        else:
            assert plp.top_token_ids == []


def test_completions_echo_with_logprobs_lists_the_prompt_first(rt):
    tok = rt.client.tokenizer
    prompt = random_prompts(384, lengths=(8,), seed=4)[0]
    body = dict(prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, return_token_ids=True)
    free = post(rt, "/v1/completions", body).json()["choices"][0]
    r = post(rt, "/v1/completions", {**body, "echo": True})
    assert r.status_code == 200, r.text
    echo = r.json()["choices"][0]
    lp = echo["logprobs"]
    assert echo["text"] == tok.decode(prompt) + free["text"]
    assert echo["token_ids"] == free["token_ids"]
    assert lp["tokens"] == [tok.decode([t]) for t in prompt] + free["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    lsm = log_softmax(rt.target, prompt)[:-1]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:len(prompt)]),
                               lsm[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)
    for i, top in enumerate(lp["top_logprobs"][1:len(prompt)]):
        assert lp["tokens"][i + 1] in top and 2 <= len(top) <= 3
        for t, v in zip(lsm[i].topk(2).indices.tolist(), lsm[i].topk(2).values.tolist()):
            # (tokens whose strings coincide keep the most likely one's logprob)
            assert top[tok.decode([t])] >= v - 1e-4 or tok.decode([t]) == lp["tokens"][i + 1]
    # (the prefill's logits of more rows are another matmul shape: equal to float rounding)
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][len(prompt):]),
                               torch.tensor(free["logprobs"]["token_logprobs"]), atol=1e-5, rtol=0)
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    # Streamed: the first chunk carries the prompt's entries, the rest follow.
    with httpx.stream("POST", rt.url + "/v1/completions",
                      json={"model": MODEL, **body, "echo": True, "stream": True}, timeout=120) as s:
        chunks = [json.loads(x[5:]) for x in s.iter_lines() if x.startswith("data:") and "[DONE]" not in x]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for part in streamed for x in part[key]] == lp[key], key
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echo["text"]


def test_vllm_prompt_logprobs_on_both_endpoints(rt):
    tok = rt.client.tokenizer
    prompt = random_prompts(384, lengths=(7,), seed=9)[0]
    before = len(rt.submitted)
    r = post(rt, "/v1/completions", dict(prompt=prompt, max_tokens=3, temperature=0, prompt_logprobs=2, n=2))
    assert r.status_code == 200, r.text
    # n samples of a whole response: the engine computes the prompt's logprobs once.
    assert [sp.prompt_logprobs for _, sp in rt.submitted[before:]] == [2, None]
    plps = [c["prompt_logprobs"] for c in r.json()["choices"]]
    assert plps[0] == plps[1] and plps[0][0] is None and len(plps[0]) == len(prompt)
    assert r.json()["choices"][0]["logprobs"] is None
    lsm = log_softmax(rt.target, prompt)[:-1]
    for i, d in enumerate(plps[0][1:]):
        keys = list(d)
        assert keys[0] == str(prompt[i + 1])  # the prompt's own token first
        own = d[keys[0]]
        assert abs(own["logprob"] - lsm[i, prompt[i + 1]].item()) < 1e-4
        assert own["rank"] == int((lsm[i] > lsm[i, prompt[i + 1]] + 1e-5).sum()) + 1
        assert own["decoded_token"] == tok.decode([prompt[i + 1]])
        top = lsm[i].topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert d[str(t)]["rank"] == rank and abs(d[str(t)]["logprob"] - v) < 1e-4
        assert len(d) == 2 + (own["rank"] > 2)
    # Chat: the response carries them, for the prompt the chat template made.
    messages = [{"role": "user", "content": "Hello there"}]
    r = post(rt, "/v1/chat/completions", dict(messages=messages, max_tokens=3, temperature=0, prompt_logprobs=0))
    assert r.status_code == 200, r.text
    ids = rt.client.encode_chat(messages)
    plp = r.json()["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert [list(d) for d in plp[1:]] == [[str(t)] for t in ids[1:]]
    lsm = log_softmax(rt.target, ids)[:-1]
    torch.testing.assert_close(torch.tensor([d[str(t)]["logprob"] for d, t in zip(plp[1:], ids[1:])]),
                               lsm[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21},
                                   {"prompt_logprobs": -1}])
def test_prompt_logprobs_refusals_name_the_field(rt, path, base, extra):
    before = len(rt.submitted)
    r = post(rt, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs" and "prompt_logprobs" in r.json()["error"]["message"]
    assert len(rt.submitted) == before


def test_http_client_rebuilds_the_engines_prompt_logprobs(rt):
    from spec_runtime.client import Client

    prompt = random_prompts(384, lengths=(10,), seed=13)[0]
    sp = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3)
    local = rt.client.generate(prompt, sp)
    with Client.connect(rt.url, model=MODEL) as http:
        remote = http.generate(prompt, sp)
        chat = http.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert remote.token_ids == local.token_ids
    a, b = remote.prompt_logprobs, local.prompt_logprobs
    assert a.ranks == b.ranks and a.top_token_ids == b.top_token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(a.top_logprobs), torch.tensor(b.top_logprobs), atol=1e-6, rtol=0)
    ids = rt.client.encode_chat([{"role": "user", "content": "Hi"}])
    assert len(chat.prompt_logprobs.logprobs) == len(ids) - 1 and all(len(t) == 1 for t in chat.prompt_logprobs.top_token_ids)
