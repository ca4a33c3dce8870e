"""Structured outputs and tools over HTTP, on SmolLM2-135M-Instruct (SD, n-gram draft).

The server runs with `ChatConfig(chat_template=...)`: a Hermes-style template that renders
the tools, since SmolLM2's own template renders none. tool_choice named and required
force a valid call through structured outputs; auto parses the model's text (here made
a call by a regex constraint, so the test does not hang on what a 135M model chooses);
none renders no tools and parses nothing.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from e2e_util import record_submits, serve_in_thread
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from spec_runtime.server.app import build_app
from spec_runtime.server.async_client import AsyncClient
from spec_runtime.server.chat_config import ChatConfig

MODEL = "smol"
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smollm2_gguf_path):
    cfg = RuntimeConfig(target=ModelConfig(path=smollm2_gguf_path), draft=ModelConfig(path=""),
                        spec=SpeculativeConfig(mode="sd", k=4, draft_timeout_s=60.0),
                        sched=SchedulerConfig(max_batch_size=4, max_model_len=1024, spec_policy="always"),
                        startup_timeout_s=300.0)
    aclient = AsyncClient(cfg)
    submitted = record_submits(aclient)
    app = build_app(aclient, served_model_name=MODEL, chat=ChatConfig(chat_template=TEMPLATE))
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, client=aclient.client, submitted=submitted)
    aclient.client.close()


def chat(server, **body):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80, "temperature": 0, **body}
    if not body.get("stream"):
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.chunks = [json.loads(line[5:]) for line in r.iter_lines()
                    if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    return r


def test_response_format_json_schema_and_json_object(server):
    r = chat(server, messages=[{"role": "user", "content": "Describe a person."}],
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]
    jsonschema.validate(json.loads(msg["message"]["content"]), PERSON)
    assert msg["finish_reason"] == "stop"
    r = chat(server, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_vllm_guided_fields_on_both_endpoints(server):
    r = chat(server, guided_choice=["sunny", "rainy"])
    assert r.json()["choices"][0]["message"]["content"] in ("sunny", "rainy")
    r = chat(server, structured_outputs={"regex": "[0-9]{3}"})
    assert len(r.json()["choices"][0]["message"]["content"]) == 3
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "A person:", "max_tokens": 60, "temperature": 0, "guided_json": PERSON})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)


def test_named_tool_choice_forces_the_function(server):
    r = chat(server, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    prompt = server.client.tokenizer.decode(server.submitted[-1][0])
    assert '"name": "get_weather"' in prompt and "get_time" in prompt  # the template rendered the tools


@pytest.mark.parametrize("stream", [False, True])
def test_required_returns_valid_calls(server, stream):
    r = chat(server, tools=[WEATHER, TIME], tool_choice="required", stream=stream, parallel_tool_calls=False)
    assert r.status_code == 200
    if stream:
        final = r.chunks[-1]["choices"][0]
        calls, reason = final["delta"]["tool_calls"], final["finish_reason"]
        assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in r.chunks)
    else:
        choice = r.json()["choices"][0]
        calls, reason = choice["message"]["tool_calls"], choice["finish_reason"]
    assert reason == "tool_calls" and len(calls) == 1
    fn = {"get_weather": WEATHER, "get_time": TIME}[calls[0]["function"]["name"]]["function"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), fn["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_call(server, stream):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
    regex = r"Let me check\. " + call.replace("{", r"\{").replace("}", r"\}")
    r = chat(server, tools=[WEATHER], structured_outputs={"regex": regex}, stream=stream)
    assert r.status_code == 200
    if stream:
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in r.chunks)
        final = r.chunks[-1]["choices"][0]
        calls, reason = final["delta"]["tool_calls"], final["finish_reason"]
    else:
        msg = r.json()["choices"][0]
        content, calls, reason = msg["message"]["content"], msg["message"]["tool_calls"], msg["finish_reason"]
    assert content == "Let me check. " and reason == "tool_calls"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}


def test_tool_choice_none_never_returns_calls(server):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
    r = chat(server, tools=[WEATHER], tool_choice="none",
             structured_outputs={"regex": call.replace("{", r"\{").replace("}", r"\}")})
    msg = r.json()["choices"][0]
    assert msg["message"]["content"] == call and "tool_calls" not in msg["message"] and msg["finish_reason"] == "stop"
    prompt = server.client.tokenizer.decode(server.submitted[-1][0])
    assert "You may call these functions" not in prompt


def test_tool_history_goes_through_the_template(server):
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = chat(server, messages=history, tools=[WEATHER], max_tokens=5)
    assert r.status_code == 200, r.text
    prompt = server.client.tokenizer.decode(server.submitted[-1][0])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny, 21 C" in prompt


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"colour": 1}}, "structured_outputs.colour"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_json": PERSON, "min_tokens": 3}, "min_tokens"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
])
def test_bad_structured_fields_are_400s_naming_them(server, body, param):
    before = len(server.submitted)
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert len(server.submitted) == before
