"""Tool calls: the Hermes and Llama-3 JSON parsers, tool_choice handling, and how a
choice streams content and calls. Pure CPU, no model."""

from __future__ import annotations

import json

import pytest

from protocol.messages import RequestOutput
from spec_runtime.server.openai_protocol import APIError
from spec_runtime.server.openai_responses import Choice
from spec_runtime.server.tool_calls import (
    ParsedCall,
    parse_hermes,
    parse_llama3_json,
    parser_for_template,
    safe_content_len,
    tool_request,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


def test_hermes_parses_calls_after_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": {"query": "rain"}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n"
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("search", '{"query": "rain"}')]


def test_hermes_unclosed_last_call_and_bad_json():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}')[1] == [ParsedCall("f", "{}")]
    text = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parse_hermes(text) == (text, [])
    assert parse_hermes("no calls here") == ("no calls here", [])
    # Arguments given as JSON text are accepted too.
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1] == [
        ParsedCall("f", '{"a": 1}')]


def test_llama3_json_parses_one_or_several_calls():
    assert parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (
        "", [ParsedCall("get_weather", '{"city": "Oslo"}')])
    content, calls = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert content == "" and [c.name for c in calls] == ["a", "b"] and calls[1].arguments == '{"x": 1}'
    for text in ("The answer is 4.", '{"name": "a", "parameters": {}} and more', '{"not_a_call": 1}', "{broken"):
        assert parse_llama3_json(text) == (text, [])


def test_safe_content_len_holds_back_a_possible_call():
    assert safe_content_len("hermes", "Hello there") == len("Hello there")
    assert safe_content_len("hermes", "Hello <tool_") == len("Hello ")
    assert safe_content_len("hermes", "Hi <tool_call>{") == 3
    assert safe_content_len("hermes", "a < b") == len("a < b")
    assert safe_content_len("llama3_json", "  {\"na") == 0
    assert safe_content_len("llama3_json", "<|pyth") == 0
    assert safe_content_len("llama3_json", "Sure") == 4


def test_parser_for_template():
    assert parser_for_template("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
    assert parser_for_template(None) is None


def test_tool_request_choices_and_forcing_schemas():
    tr = tool_request([WEATHER, SEARCH], None, None)
    assert tr.choice == "auto" and tr.structured() is None and len(tr.template_tools()) == 2
    assert tool_request([WEATHER], "none", None).template_tools() is None
    named = tool_request([WEATHER, SEARCH], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.choice == "named" and json.loads(named.structured().spec) == WEATHER["function"]["parameters"]
    assert named.calls_from('{"city": "Rome"}', None) == ("", [ParsedCall("get_weather", '{"city": "Rome"}')])
    required = tool_request([WEATHER, SEARCH], "required", False)
    schema = json.loads(required.structured().spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    content, calls = required.calls_from('[{"name": "search", "parameters": {"q": "x"}}]', None)
    assert content == "" and calls == [ParsedCall("search", '{"q": "x"}')]
    # Cut by max_tokens before the array closed: no calls, the text stays content.
    assert required.calls_from('[{"name": "sea', None) == ('[{"name": "sea', [])
    # auto: calls to unknown functions are not calls; parallel_tool_calls=false keeps the first.
    auto = tool_request([WEATHER], "auto", False)
    assert auto.calls_from('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "hermes")[1] == []
    two = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>' * 2
    assert len(auto.calls_from(two, "hermes")[1]) == 1


@pytest.mark.parametrize("tools,choice,parallel,param", [
    ("x", None, None, "tools"),
    ([{"type": "function"}], None, None, "tools.0"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "colour": 1}}], None, None, "tools.0.function.colour"),
    ([WEATHER, WEATHER], None, None, "tools"),
    ([WEATHER], "sometimes", None, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
    (None, "required", None, "tool_choice"),
    (None, None, True, "parallel_tool_calls"),
    ([WEATHER], None, "yes", "parallel_tool_calls"),
])
def test_bad_tool_fields_are_400s_naming_them(tools, choice, parallel, param):
    with pytest.raises(APIError) as e:
        tool_request(tools, choice, parallel)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def _outs(pieces: list[str]) -> list[RequestOutput]:
    return [RequestOutput(request_id="r", new_token_ids=[i], text_delta=p, finished=i == len(pieces) - 1,
                          finish_reason="stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]


def test_stream_sends_content_then_calls_in_the_final_chunk():
    tools = tool_request([WEATHER], "auto", None)
    choice = Choice(0, True, None, tools=tools, parser="hermes")
    pieces = ["Checking", " now <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "</tool_call>"]
    chunks = [choice.add(o) for o in _outs(pieces)]
    streamed = "".join(c["delta"].get("content") or "" for c in chunks)
    assert streamed == "Checking now "
    final = chunks[-1]
    assert final["finish_reason"] == "tool_calls"
    (call,) = final["delta"]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert all("tool_calls" not in c["delta"] for c in chunks[:-1])
    whole = choice.whole()
    assert whole["message"]["content"] == "Checking now " and whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_stream_without_a_call_sends_all_text_and_tool_choice_none_parses_nothing():
    choice = Choice(0, True, None, tools=tool_request([WEATHER], "auto", None), parser="hermes")
    chunks = [choice.add(o) for o in _outs(["a <tool", "box> b"])]
    assert "".join(c["delta"]["content"] for c in chunks) == "a <toolbox> b"
    assert chunks[-1]["finish_reason"] == "stop" and "tool_calls" not in chunks[-1]["delta"]
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    none = Choice(0, True, None, tools=tool_request([WEATHER], "none", None), parser=None)
    chunks = [none.add(o) for o in _outs([text])]
    assert chunks[-1]["delta"]["content"] == text and "tool_calls" not in none.whole()["message"]


def test_named_choice_holds_its_json_and_finishes_with_stop():
    tools = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    choice = Choice(0, True, None, tools=tools, parser="hermes")
    chunks = [choice.add(o) for o in _outs(['{"city": ', '"Lima"}'])]
    assert [c["delta"]["content"] for c in chunks] == ["", ""]
    assert chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    assert choice.whole()["message"]["content"] is None
