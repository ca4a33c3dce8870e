"""Tool calling: `tools` and `tool_choice` of a chat request, and the parsers that turn
generated text into OpenAI `tool_calls`.

tool_choice, as vLLM serves it:
  - "none": the tools are not rendered into the prompt and no text is parsed as a call;
  - "auto" (the default with tools): the tools go to the chat template, and a tool-call
    parser reads the model's own call format out of the text;
  - "required": the output is constrained (structured outputs) to a JSON array of one or
    more {"name", "parameters"} objects, one per call, each valid for its function;
  - {"type": "function", "function": {"name": ...}}: the output is constrained to that
    function's parameters, and is the call's arguments.

Parsers (`--tool-call-parser`, "auto" picks by what the chat template contains):
  - hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
    after optional content (Hermes, Qwen2.5/3 templates);
  - llama3_json: the whole output is `{"name": ..., "parameters": {...}}` (optionally
    after `<|python_tag|>`), several separated by `;` (Llama 3.1/3.2 templates).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from protocol.messages import StructuredOutputs
from spec_runtime.server.errors import APIError

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_body(call: ParsedCall, index: int | None = None, call_id: str | None = None) -> dict:
    """An OpenAI tool_calls entry (with `index` in streamed deltas)."""
    body = {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        body = {"index": index, **body}
    return body


def _args_text(value: Any) -> str | None:
    """Arguments as JSON text: an object, or JSON text of one; None if neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_of(obj: Any, arg_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arg_keys:
        if key in obj:
            args = _args_text(obj[key])
            return None if args is None else ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], "{}")


def parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    """(content before the first call, calls). No calls where any block does not parse
    (the text is then all content)."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    pos = start
    while pos >= 0:
        body_start = pos + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]  # an unclosed last block ends the text
        try:
            call = _call_of(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
        if end < 0:
            break
        pos = text.find(_HERMES_OPEN, end + len(_HERMES_CLOSE))
    return text[:start], calls


def parse_llama3_json(text: str) -> tuple[str, list[ParsedCall]]:
    """Calls when the whole output is one or more `;`-separated JSON calls, else ([text], [])."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, []
        pos = len(body) - len(rest)
    return "", calls


def safe_content_len(parser: str, text: str) -> int:
    """How much of a growing `text` is content for sure: nothing after it can turn it
    into part of a call, so a stream may send it."""
    if parser == "hermes":
        i = text.find(_HERMES_OPEN)
        if i >= 0:
            return i
        for n in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a marker may be arriving
            if _HERMES_OPEN.startswith(text[-n:]):
                return len(text) - n
        return len(text)
    body = text.lstrip()
    if not body or body.startswith("{") or body.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(body):
        return 0
    return len(text)


def parse(parser: str, text: str) -> tuple[str, list[ParsedCall]]:
    return parse_hermes(text) if parser == "hermes" else parse_llama3_json(text)


def parser_for_template(template: str | None) -> str | None:
    """The parser whose format a chat template renders, or None when it renders no tools."""
    if not template or "tools" not in template:
        return None
    if _HERMES_OPEN in template:
        return "hermes"
    if "python_tag" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def tool_parser(template, configured: str) -> str:
    """The parser for a request with rendered tools: `configured`, or (auto) the one the
    chat template's format names; a 400 naming `tools` when the template renders none."""
    found = parser_for_template(template if isinstance(template, str) else None)
    if found is None:
        raise APIError(400, "tools: the chat template does not render tools (serve with --chat-template to "
                       "give one that does)", param="tools")
    return found if configured == "auto" else configured


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one chat request and what tool_choice makes of them."""

    functions: tuple[dict, ...]  # {"name", "description"?, "parameters"?}
    choice: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates receive them (None: not rendered)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def structured(self) -> StructuredOutputs | None:
        """The constraint that forces a valid call (required, named), else None."""
        if self.choice == "named":
            f = next(f for f in self.functions if f["name"] == self.named)
            return StructuredOutputs(kind="json_schema", spec=json.dumps(_params(f)))
        if self.choice != "required":
            return None
        one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                       "parameters": _params(f)},
                   "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(kind="json_schema", spec=json.dumps(schema))

    def calls_from(self, text: str, parser: str | None) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a finished output."""
        if self.choice == "none":
            return text, []
        if self.choice == "named":
            return "", [ParsedCall(self.named, _args_text(text) or text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut by max_tokens: the constraint never finished
            calls = [_call_of(x, ("parameters",)) for x in items] if isinstance(items, list) else [None]
            return ("", calls) if calls and all(calls) else (text, [])
        content, calls = parse(parser, text)
        if any(c.name not in self.names for c in calls):
            return text, []
        if calls and not self.parallel:
            calls = calls[:1]
        return content, calls

    def holds_content(self) -> bool:
        """required and named produce no content: their text is the calls."""
        return self.choice in ("required", "named")


def _params(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`; None without tools.
    APIError(400) naming the field that is wrong."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        if parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls: needs tools", param="parallel_tool_calls")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools: must be a list of {type: function, function: {...}}", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"{where}: must be {{type: function, function: {{name, ...}}}}", param=where)
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise APIError(400, f"{where}.{sorted(unknown)[0]}: unknown field", param=f"{where}.{sorted(unknown)[0]}")
        f = tool["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(400, f"{where}.function.name: must be 1-64 letters, digits, _ . or -",
                           param=f"{where}.function.name")
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            p = f"{where}.function.{sorted(unknown)[0]}"
            raise APIError(400, f"{p}: unknown field", param=p)
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise APIError(400, f"{where}.function.parameters: must be a JSON schema object",
                           param=f"{where}.function.parameters")
        if "description" in f and not isinstance(f["description"], str):
            raise APIError(400, f"{where}.function.description: must be a string", param=f"{where}.function.description")
        functions.append({k: v for k, v in f.items() if k != "strict"})
    if len({f["name"] for f in functions}) != len(functions):
        raise APIError(400, "tools: function names must be unique", param="tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls: must be a boolean", param="parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolRequest(tuple(functions), tool_choice or "auto", parallel=parallel)
    if (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str)):
        name = tool_choice["function"]["name"]
        if name not in {f["name"] for f in functions}:
            raise APIError(400, f"tool_choice.function.name: {name!r} is not one of the tools",
                           param="tool_choice.function.name")
        return ToolRequest(tuple(functions), "named", named=name, parallel=parallel)
    raise APIError(400, "tool_choice: must be none, auto, required or {type: function, function: {name}}",
                   param="tool_choice")
