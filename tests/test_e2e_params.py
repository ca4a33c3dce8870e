"""Sampling and output parameters end to end, with speculation on, against AR and references.

One SD runtime (tiny random llama target, perturbed draft, K = 3) served over HTTP, and
an AR runtime of the same target in-process. Penalties and friends must give AR's
greedy output token for token (and a plain reference loop's), and AR's distribution when
sampling; logprobs must be the target's log-softmax.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from e2e_util import first_tokens, homogeneity_pvalue, make_config, random_prompts, serve_in_thread
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient
from test_logits_process import _reference_process

MODEL = "tiny"
EOS = 2


@pytest.fixture(scope="module")
def rt(tiny_pair):
    target, draft = tiny_pair
    aclient = AsyncClient(make_config(target, draft, mode="sd", k=3, max_batch_size=16))
    with Client(make_config(target, mode="ar", max_batch_size=16)) as ar:
        with serve_in_thread(build_app(aclient, served_model_name=MODEL)) as url:
            yield SimpleNamespace(url=url, sd=aclient.client, ar=ar, target=target,
                                  prompt=random_prompts(384, lengths=(7,), seed=5)[0])
    aclient.client.close()


def complete(rt, **body) -> dict:
    body = {"model": MODEL, "prompt": rt.prompt, "return_token_ids": True, **body}
    r = httpx.post(rt.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(rt, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", rt.url + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    return [json.loads(x) for x in data if x != "[DONE]"]


@functools.lru_cache(maxsize=1)
def _hf_model(target: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)


def reference_greedy(target: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """A plain loop: transformers' logits, the textbook processors, argmax."""
    model = _hf_model(target)
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < sp.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            tok = int(_reference_process(logits, sp, prompt, out).argmax())
            out.append(tok)
            if tok in sp.stop_token_ids or (tok == EOS and not sp.ignore_eos and len(out) >= sp.min_tokens):
                break
    return out


PROCESSORS = {
    "repetition": dict(repetition_penalty=1.8),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "logit_bias": dict(logit_bias={17: 4.0, 40: 3.0}),
    "all": dict(repetition_penalty=0.7, frequency_penalty=0.6, presence_penalty=-0.5, logit_bias={99: 2.5}),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_greedy_with_processors_equals_ar_and_reference(rt, name):
    kw = PROCESSORS[name]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **kw)
    body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in kw.items()}
    sd = complete(rt, max_tokens=24, temperature=0, ignore_eos=True, **body)["choices"][0]["token_ids"]
    ar = rt.ar.generate(rt.prompt, sp).token_ids
    plain = rt.ar.generate(rt.prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    assert sd == ar == reference_greedy(rt.target, rt.prompt, sp)
    assert sd != plain  # the processors changed the output


def test_min_tokens_masks_stops_until_reached(rt):
    plain = rt.ar.generate(rt.prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    stop = plain[1]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    body = complete(rt, max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    sd = body["choices"][0]["token_ids"]
    assert sd == rt.ar.generate(rt.prompt, sp).token_ids == reference_greedy(rt.target, rt.prompt, sp)
    assert len(sd) > 6 and stop not in sd[:6]
    if sd[-1] == stop:
        assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == stop


@pytest.mark.slow
def test_sampled_distribution_with_processors_matches_ar(rt):
    """Seeded requests at temperature 1 with penalties and min-p: each of the 5 tokens,
    and pairs of them, follow one distribution in SD and AR mode."""
    n = 800
    sp_kw = dict(max_tokens=5, temperature=1.0, top_k=8, ignore_eos=True, repetition_penalty=1.5,
                 frequency_penalty=0.5, min_p=0.05, logit_bias={30: 1.0})
    ar = first_tokens(rt.ar, rt.prompt, n, 0, sp_kw)
    sd = first_tokens(rt.sd, rt.prompt, n, 10**6, sp_kw)
    totals = rt.sd.engine_stats().totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    for pos in range(5):
        assert homogeneity_pvalue([t[pos] for t in ar], [t[pos] for t in sd]) > 0.001, pos
    for pair in ((0, 2), (2, 4)):
        assert homogeneity_pvalue([t[slice(*pair)] for t in ar], [t[slice(*pair)] for t in sd]) > 0.001, pair


def _target_log_softmax(target: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(_hf_model(target)(torch.tensor([ids])).logits[0].float(), -1)


def test_logprobs_are_the_targets_over_http_and_streaming(rt):
    tok = rt.sd.tokenizer
    body = dict(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, logprobs=3)
    whole = complete(rt, **body)["choices"][0]
    ids = whole["token_ids"]
    lsm = _target_log_softmax(rt.target, rt.prompt + ids)[len(rt.prompt) - 1: -1]  # [12, V]
    lp = whole["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"]), lsm.gather(1, torch.tensor(ids)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    for i, top in enumerate(lp["top_logprobs"]):
        ref_lp, ref_ids = lsm[i].topk(3)
        for t, v in zip(ref_ids.tolist(), ref_lp.tolist()):
            assert top[tok.decode([t])] >= v - 1e-4
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(len(ids))]
    # AR gives the same logprobs for the same tokens (greedy: the same tokens too).
    greedy = complete(rt, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)["choices"][0]
    ar = rt.ar.generate(rt.prompt, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True))
    assert greedy["token_ids"] == ar.token_ids
    torch.testing.assert_close(torch.tensor(greedy["logprobs"]["token_logprobs"]), torch.tensor(ar.logprobs),
                               atol=1e-4, rtol=0)
    # Streaming carries the same logprobs, chunk by chunk.
    chunks = stream(rt, "/v1/completions", {"prompt": rt.prompt, **body})
    streamed = [x for c in chunks if c["choices"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    # Chat: one content entry per token with its top alternatives.
    messages = [{"role": "user", "content": "Hello there"}]
    chat_body = dict(messages=messages, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2,
                     return_token_ids=True)
    r = httpx.post(rt.url + "/v1/chat/completions", json={"model": MODEL, **chat_body}, timeout=120).json()
    content = r["choices"][0]["logprobs"]["content"]
    prompt = rt.sd.encode_chat(messages)
    lsm = _target_log_softmax(rt.target, prompt + r["choices"][0]["token_ids"])[len(prompt) - 1: -1]
    for i, entry in enumerate(content):
        assert abs(entry["logprob"] - lsm[i].max().item()) < 1e-4  # greedy: the argmax
        assert [round(a["logprob"], 4) for a in entry["top_logprobs"]] == [round(v, 4) for v in lsm[i].topk(2)[0].tolist()]
        assert entry["bytes"] == list(entry["token"].encode())
    # The same tokens and alternatives; logprobs to float32 noise (the two runs' steps may
    # verify different numbers of tokens: the speculation policy measures time).
    chunks = stream(rt, "/v1/chat/completions", chat_body)
    streamed = [e for c in chunks if c["choices"] for e in c["choices"][0]["logprobs"]["content"]]

    def shape(entries):
        return [(e["token"], e["bytes"], [(a["token"], a["bytes"]) for a in e["top_logprobs"]]) for e in entries]

    def values(entries):
        return torch.tensor([[e["logprob"]] + [a["logprob"] for a in e["top_logprobs"]] for e in entries])

    assert shape(streamed) == shape(content)
    torch.testing.assert_close(values(streamed), values(content), atol=1e-4, rtol=0)


def test_n_samples_are_seeded_requests(rt):
    body = complete(rt, max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == len(rt.prompt)
    for j, c in enumerate(body["choices"]):
        single = complete(rt, max_tokens=8, temperature=1.0, seed=11 + j, ignore_eos=True)["choices"][0]
        assert c["token_ids"] == single["token_ids"]
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1
    # A batch of prompts times n: choices indexed prompt * n + sample.
    prompts = [rt.prompt, rt.prompt[:4]]
    batch = complete(rt, prompt=prompts, max_tokens=5, temperature=0, n=2, ignore_eos=True)
    ids = [c["token_ids"] for c in batch["choices"]]
    assert ids[0] == ids[1] and ids[2] == ids[3] and batch["usage"]["prompt_tokens"] == 7 + 4
    assert ids[2] == complete(rt, prompt=prompts[1], max_tokens=5, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
    chunks = stream(rt, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2,
                                            "ignore_eos": True, "return_token_ids": True})
    for i in range(4):
        assert [t for c in chunks for ch in c["choices"] if ch["index"] == i for t in ch["token_ids"]] == ids[i]


def test_echo_stop_strings_and_special_tokens(rt):
    tok = rt.sd.tokenizer
    free = complete(rt, max_tokens=30, temperature=0, ignore_eos=True)["choices"][0]
    echo = complete(rt, max_tokens=30, temperature=0, ignore_eos=True, echo=True)["choices"][0]
    assert echo["text"] == tok.decode(rt.prompt) + free["text"]
    chunks = stream(rt, "/v1/completions", {"prompt": rt.prompt, "max_tokens": 30, "temperature": 0,
                                            "ignore_eos": True, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echo["text"]
    text = free["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = complete(rt, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    kept = complete(rt, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                    include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[: text.index(stop) + len(stop)] and kept["stop_reason"] == stop
    assert free["stop_reason"] is None and free["finish_reason"] == "length"
    # A forced special token: dropped from the text by default, kept with skip_special_tokens false.
    special = tok.convert_tokens_to_ids("<|im_start|>")
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={str(special): 100})
    skipped = complete(rt, **forced)["choices"][0]
    shown = complete(rt, **forced, skip_special_tokens=False)["choices"][0]
    assert skipped["token_ids"] == shown["token_ids"] == [special] * 3
    assert skipped["text"] == "" and shown["text"] == "<|im_start|>" * 3
