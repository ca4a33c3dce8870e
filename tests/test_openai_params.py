"""Every OpenAI request field is honoured or refused by name: none passes silently.

The field lists come from the installed `openai` package's request types, so a field
OpenAI adds fails `test_every_openai_field_is_classified` until it is implemented or
refused here. One server (tiny random llama target, perturbed draft, SD, K = 3, CPU)
whose chat template renders tool calls, tool results and a template kwarg.
"""

from __future__ import annotations

import json
import typing
from types import SimpleNamespace

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat import completion_create_params as chat_params

from conftest import save_tiny_model
from e2e_util import make_config, perturbed_copy, record_submits, serve_in_thread
from protocol.messages import StructuredOutputs
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient
from spec_runtime.server.openai_protocol import NO_OP_FIELDS

MODEL = "tiny"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.get('name') %}({{ m['name'] }}){% endif %}\n"
    "{{ m['content'] }}{% for c in m.get('tool_calls', []) %}[call {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}{% if m.get('tool_call_id') %}"
    "[result of {{ m['tool_call_id'] }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("params")
    target = save_tiny_model(root / "target", "llama")
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(target)
    draft = perturbed_copy(target, str(root / "draft"), noise=0.2)
    aclient = AsyncClient(make_config(target, draft, mode="sd", k=3))
    submitted = record_submits(aclient)
    with serve_in_thread(build_app(aclient, served_model_name=MODEL)) as url:
        yield SimpleNamespace(url=url, client=aclient.client, submitted=submitted)
    aclient.client.close()


def post(server, path: str, body: dict) -> tuple[httpx.Response, list]:
    """The response, and the (prompt ids, SamplingParams) that reached the engine."""
    before = len(server.submitted)
    if body.get("stream"):
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            if r.status_code != 200:
                r.read()
                return r, server.submitted[before:]
            lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        r.chunks = [json.loads(x) for x in lines if x != "[DONE]"]
    else:
        r = httpx.post(server.url + path, json=body, timeout=60)
    return r, server.submitted[before:]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0},
    COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
}


def sp_is(**expected):
    def check(r, subs):
        assert r.status_code == 200, r.text
        for _, sp in subs:
            for name, value in expected.items():
                assert getattr(sp, name) == value, (name, getattr(sp, name), value)
    return check


def no_op(r, subs):
    assert r.status_code == 200, r.text
    assert len(subs) == 1


def choices(n):
    def check(r, subs):
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == list(range(n)) and len(subs) == n
    return check


def chat_logprobs(num_top):
    def check(r, subs):
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == r.json()["usage"]["completion_tokens"]
        assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == num_top for e in content)
    return check


def completion_logprobs(r, subs):
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    # Two alternatives and the sampled token (fewer where their strings coincide).
    assert all(1 <= len(top) <= 3 and top[t] == x for top, t, x in zip(lp["top_logprobs"], lp["tokens"],
                                                                        lp["token_logprobs"]))


def prompt_logprobs(r, subs):
    assert r.status_code == 200, r.text
    body = r.json()
    plp = body["prompt_logprobs"] if "messages" in r.request.content.decode() else body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(subs[0][0]) and plp[0] is None and subs[0][1].prompt_logprobs == 1
    assert all(1 <= len(d) <= 2 and all(v["logprob"] <= 0 for v in d.values()) for d in plp[1:])


def usage_chunk(r, subs):
    assert r.status_code == 200
    assert r.chunks[-1]["choices"] == [] and r.chunks[-1]["usage"]["completion_tokens"] == 4


def echoed(r, subs):
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("Hello")


REFUSED = "refused"
# field -> (value, extra body, expectation): REFUSED (400 naming it) or a check.
CHAT_FIELDS = {
    "audio": ({"voice": "alloy", "format": "wav"}, {}, REFUSED),
    "frequency_penalty": (0.5, {}, sp_is(frequency_penalty=0.5)),
    "function_call": ("auto", {}, REFUSED),
    "functions": ([{"name": "f", "parameters": {}}], {}, REFUSED),
    "logit_bias": ({"5": 10}, {}, sp_is(logit_bias={5: 10.0})),
    "logprobs": (True, {}, chat_logprobs(0)),
    "max_completion_tokens": (3, {}, sp_is(max_tokens=3)),
    "max_tokens": (3, {}, sp_is(max_tokens=3)),
    "metadata": ({"k": "v"}, {}, no_op),
    "modalities": (["text", "audio"], {}, REFUSED),
    "moderation": ({"model": "omni-moderation-latest"}, {}, REFUSED),
    "n": (3, {}, choices(3)),
    "parallel_tool_calls": (True, {}, REFUSED),
    "prediction": ({"type": "content", "content": "Hi"}, {}, no_op),
    "presence_penalty": (-0.5, {}, sp_is(presence_penalty=-0.5)),
    "prompt_cache_key": ("k", {}, no_op),
    "prompt_cache_options": ({"mode": "implicit"}, {}, no_op),
    "prompt_cache_retention": ("24h", {}, no_op),
    "reasoning_effort": ("low", {}, REFUSED),
    "response_format": ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, {},
                        sp_is(structured=StructuredOutputs(kind="json_schema", spec="{}"))),
    "safety_identifier": ("u1", {}, no_op),
    "seed": (7, {}, sp_is(seed=7)),
    "service_tier": ("auto", {}, no_op),
    "stop": (["\n", "x"], {}, sp_is(stop=["\n", "x"])),
    "store": (True, {}, no_op),
    "stream": (True, {}, lambda r, subs: r.chunks[-1]["choices"][0]["finish_reason"] is not None),
    "stream_options": ({"include_usage": True}, {"stream": True}, usage_chunk),
    "temperature": (0.5, {}, sp_is(temperature=0.5)),
    "tool_choice": ("auto", {}, REFUSED),
    # The tiny template renders no tools: a 400 naming `tools` (tests/test_structured_http.py serves tools).
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {}}}], {}, REFUSED),
    "top_logprobs": (2, {"logprobs": True}, chat_logprobs(2)),
    "top_p": (0.5, {}, sp_is(top_p=0.5)),
    "user": ("u1", {}, no_op),
    "verbosity": ("low", {}, REFUSED),
    "web_search_options": ({}, {}, REFUSED),
}
COMPLETION_FIELDS = {
    "best_of": (2, {"n": 2}, choices(2)),
    "echo": (True, {}, echoed),
    "frequency_penalty": (0.5, {}, sp_is(frequency_penalty=0.5)),
    "logit_bias": ({"7": -100}, {}, sp_is(logit_bias={7: -100.0})),
    "logprobs": (2, {}, completion_logprobs),
    "max_tokens": (3, {}, sp_is(max_tokens=3)),
    "n": (2, {}, choices(2)),
    "presence_penalty": (0.5, {}, sp_is(presence_penalty=0.5)),
    "seed": (7, {}, sp_is(seed=7)),
    "stop": ("\n", {}, sp_is(stop=["\n"])),
    "stream": (True, {}, lambda r, subs: r.chunks[-1]["choices"][0]["finish_reason"] is not None),
    "stream_options": ({"include_usage": True}, {"stream": True}, usage_chunk),
    "suffix": ("the end", {}, REFUSED),
    "temperature": (0.5, {}, sp_is(temperature=0.5)),
    "top_p": (0.5, {}, sp_is(top_p=0.5)),
    "user": ("u1", {}, no_op),
}
# vLLM's extensions that spec-runtime implements (the same on both endpoints unless noted).
EXTENSIONS = {
    "top_k": (5, {}, sp_is(top_k=5)),
    "min_p": (0.1, {}, sp_is(min_p=0.1)),
    "min_tokens": (2, {}, sp_is(min_tokens=2)),
    "repetition_penalty": (1.3, {}, sp_is(repetition_penalty=1.3)),
    "stop_token_ids": ([9], {}, sp_is(stop_token_ids=[9])),
    "ignore_eos": (True, {}, sp_is(ignore_eos=True)),
    "skip_special_tokens": (False, {}, sp_is(skip_special_tokens=False)),
    "include_stop_str_in_output": (True, {}, sp_is(include_stop_str_in_output=True)),
    "return_token_ids": (True, {}, lambda r, subs: len(r.json()["choices"][0]["token_ids"]) == 4),
    "guided_json": ({"type": "object"}, {}, sp_is(structured=StructuredOutputs(kind="json_schema",
                                                                               spec='{"type":"object"}'))),
    "guided_regex": ("[a-c]+", {}, sp_is(structured=StructuredOutputs(kind="regex", spec="[a-c]+"))),
    "guided_choice": (["x", "y"], {}, sp_is(structured=StructuredOutputs(kind="choice", spec='["x", "y"]'))),
    "guided_grammar": ('start: "a"+', {}, sp_is(structured=StructuredOutputs(kind="grammar", spec='start: "a"+'))),
    "structured_outputs": ({"regex": "b+"}, {}, sp_is(structured=StructuredOutputs(kind="regex", spec="b+"))),
    "prompt_logprobs": (1, {}, prompt_logprobs),
}
PARAMS = ([(CHAT, name) for name in CHAT_FIELDS] + [(COMPLETIONS, name) for name in COMPLETION_FIELDS]
          + [(path, name) for path in (CHAT, COMPLETIONS) for name in EXTENSIONS])


def _schema(cls) -> set[str]:
    return set(typing.get_type_hints(cls)) | {"stream"}


def test_every_openai_field_is_classified():
    chat = _schema(chat_params.CompletionCreateParamsBase) - {"model", "messages"}
    completion = _schema(completion_params.CompletionCreateParamsBase) - {"model", "prompt"}
    assert chat == set(CHAT_FIELDS), chat ^ set(CHAT_FIELDS)
    assert completion == set(COMPLETION_FIELDS), completion ^ set(COMPLETION_FIELDS)
    # Every accepted-and-ignored field is listed in the code, and only those.
    ignored = {name for name, (_, _, check) in {**CHAT_FIELDS, **COMPLETION_FIELDS}.items() if check is no_op}
    assert ignored == set(NO_OP_FIELDS)
    assert set(typing.get_type_hints(ChatCompletionStreamOptionsParam)) == {"include_usage", "include_obfuscation"}


@pytest.mark.parametrize("path,name", PARAMS)
def test_field_is_honoured_or_refused_by_name(server, path, name):
    table = {CHAT: CHAT_FIELDS, COMPLETIONS: COMPLETION_FIELDS}[path]
    value, extra, expect = table[name] if name in table else EXTENSIONS[name]
    body = {**BASE[path], **extra, name: value}
    r, subs = post(server, path, body)
    if expect is REFUSED:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"] and err["type"] == "invalid_request_error"
        assert not subs, "a refused request reached the engine"
    else:
        assert expect(r, subs) is not False


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("name", ["use_beam_search", "temprature", "best_of_n"])
def test_unknown_and_unimplemented_fields_are_refused_by_name(server, path, name):
    r, subs = post(server, path, {**BASE[path], name: 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "unsupported_parameter" and not subs
    r, subs = post(server, path, {**BASE[path], "stream_options": {"include_usage": True, name: 1}, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"stream_options.{name}" and not subs


MESSAGE_TYPES = (ChatCompletionUserMessageParam, ChatCompletionAssistantMessageParam, ChatCompletionToolMessageParam)


def test_message_fields_reach_the_template_or_are_refused(server):
    fields = set().union(*(typing.get_type_hints(t) for t in MESSAGE_TYPES))
    assert fields == {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call"}
    history = [
        {"role": "user", "content": "Weather in Paris?", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r, subs = post(server, CHAT, {**BASE[CHAT], "messages": history})
    assert r.status_code == 200, r.text
    prompt = server.client.tokenizer.decode(subs[0][0])
    # (the template engine trims the newline after a block tag)
    assert "<|im_start|>user(alice)Weather in Paris?" in prompt
    assert '[call call_1 get_weather {"city": "Paris"}]' in prompt
    assert "<|im_start|>toolsunny, 21 C[result of call_1]" in prompt
    for name, value in (("refusal", "no"), ("audio", {"id": "a"}), ("function_call", {"name": "f", "arguments": "{}"})):
        msgs = [history[0], {"role": "assistant", "content": "x", name: value}]
        r, subs = post(server, CHAT, {**BASE[CHAT], "messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages.1.{name}" and not subs
    bad_args = [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
                                                            "function": {"name": "f", "arguments": "{oops"}}]}]
    r, subs = post(server, CHAT, {**BASE[CHAT], "messages": bad_args})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["param"] and not subs


def test_chat_template_kwargs_and_continue_final_message(server):
    r, subs = post(server, CHAT, {**BASE[CHAT], "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200 and server.client.tokenizer.decode(subs[0][0]).endswith("assistant\n<think>")
    r, subs = post(server, CHAT, {**BASE[CHAT], "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One two"}]
    body = {**BASE[CHAT], "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True}
    r, subs = post(server, CHAT, body)
    assert r.status_code == 200, r.text
    assert server.client.tokenizer.decode(subs[0][0]).endswith("assistantOne two")
    assert r.json()["choices"][0]["message"]["content"].startswith("One two")
    r, subs = post(server, CHAT, {**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
