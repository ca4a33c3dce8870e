"""Structured-output fields of a request, as one `StructuredOutputs` constraint.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}), and vLLM's `structured_outputs`
({"json" | "regex" | "choice" | "grammar" | "json_object"}) with its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`. At most one constraint per request;
each is checked here (a schema that does not compile gets a 400 naming its field) before
the request is submitted. `grammar` is Lark syntax (llguidance's).
"""

from __future__ import annotations

import json
from typing import Any

from protocol.messages import StructuredOutputs
from spec_runtime.server.openai_protocol import APIError
from spec_runtime.structured import BACKEND, check_structured

# structured_outputs keys of vLLM that change nothing here, and those refused with why.
_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}
_SO_REFUSED = {
    "structural_tag": "structural tags are not supported",
    "whitespace_pattern": "a custom whitespace pattern is not supported",
    "disable_any_whitespace": "disable_any_whitespace is not supported",
    "disable_additional_properties": "disable_additional_properties is not supported",
}
_SO_NO_OP = {"backend", "disable_fallback"}


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, "is not valid JSON") from None
    if not isinstance(value, (dict, bool)):
        raise _bad(param, "must be a JSON schema (an object)")
    return json.dumps(value, separators=(",", ":"))


def _choice_text(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(param, "must be a non-empty list of non-empty strings")
    return json.dumps(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(param, "must be a non-empty string")
    return value


def _from_response_format(rf: Any) -> StructuredOutputs | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format", "must be an object with a string `type`")
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise _bad(f"response_format.{sorted(extra)[0]}", "unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(kind="json_object")
    if kind != "json_schema":
        raise _bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise _bad("response_format.json_schema", "must be an object with `name` and `schema`")
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise _bad(f"response_format.json_schema.{sorted(unknown)[0]}", "unknown field")
    return StructuredOutputs(kind="json_schema", spec=_schema_text(js["schema"], "response_format.json_schema.schema"))


def _from_structured_outputs(so: Any) -> list[tuple[str, StructuredOutputs]]:
    if not isinstance(so, dict):
        raise _bad("structured_outputs", "must be an object")
    found = []
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key in _SO_REFUSED:
            if value not in (None, False):
                raise APIError(400, f"{param}: {_SO_REFUSED[key]}", param=param, code="unsupported_parameter")
        elif key in _SO_NO_OP:
            if key == "backend" and value not in (None, "auto", BACKEND):
                raise _bad(param, f"this server's structured-output backend is {BACKEND!r}")
        elif key not in _SO_KINDS:
            raise APIError(400, f"{param}: unknown field", param=param, code="unsupported_parameter")
        elif value not in (None, False):
            found.append((param, _kind_value(_SO_KINDS[key], value, param)))
    return found


def _kind_value(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json_schema":
        return StructuredOutputs(kind=kind, spec=_schema_text(value, param))
    if kind == "choice":
        return StructuredOutputs(kind=kind, spec=_choice_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise _bad(param, "must be true")
        return StructuredOutputs(kind=kind)
    return StructuredOutputs(kind=kind, spec=_text(value, param))


def structured_of(req) -> tuple[str, StructuredOutputs] | None:
    """(the field that set it, the constraint) of a parsed request, or None; APIError(400)
    when several fields set one, or one is malformed or does not compile."""
    found: list[tuple[str, StructuredOutputs]] = []
    if getattr(req, "response_format", None) is not None:
        so = _from_response_format(req.response_format)
        if so is not None:
            found.append(("response_format.json_schema.schema" if so.kind == "json_schema" else "response_format", so))
    if req.structured_outputs is not None:
        found += _from_structured_outputs(req.structured_outputs)
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _kind_value(kind, value, name)))
    if req.guided_decoding_backend not in (None, "auto", BACKEND):
        raise _bad("guided_decoding_backend", f"this server's structured-output backend is {BACKEND!r}")
    if req.guided_whitespace_pattern is not None:
        raise APIError(400, "guided_whitespace_pattern: a custom whitespace pattern is not supported",
                       param="guided_whitespace_pattern", code="unsupported_parameter")
    if not found:
        return None
    if len(found) > 1:
        raise _bad(found[1][0], f"only one structured-output constraint per request ({found[0][0]} is set too)")
    param, so = found[0]
    check(so, param)
    return param, so


def check(so: StructuredOutputs, param: str) -> None:
    """APIError(400) naming `param` when the constraint does not compile."""
    err = check_structured(so)
    if err:
        raise _bad(param, f"the {so.kind.replace('_', ' ')} does not compile: {err}")


def constraint_of(req, tools) -> StructuredOutputs | None:
    """A request's constraint: its own, or the one that forces a tool call (tool_choice
    required or a named function; `tools` is its ToolRequest or None)."""
    own = structured_of(req)
    forced = tools.structured() if tools is not None else None
    if forced is None:
        return own[1] if own else None
    if own is not None:
        raise APIError(400, f"{own[0]}: cannot be combined with tool_choice {tools.choice}", param=own[0])
    check(forced, "tools")
    return forced
