"""Checks on a decoded JSON body before any model parses it.

JSON can carry what Python's str holds but UTF-8 cannot: `"\\ud800"` decodes to a lone
surrogate, which the tokenizer and the wire encoder both refuse deep inside the stack.
Nesting is bounded too: the models never need more than a few levels, and a walk over a
body nested 100,000 deep is wasted work. Both are answered with 400 naming the place.
"""

from __future__ import annotations

from typing import Any

from spec_runtime.server.openai_protocol import APIError


def check_json_body(body: Any, max_depth: int) -> None:
    """APIError(400) if any string (key or value) is not valid UTF-8 or arrays and
    objects nest deeper than max_depth. Iterative, so any depth is safe to walk."""
    stack: list[tuple[Any, int, str]] = [(body, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, (list, dict)):
            if depth >= max_depth:
                raise APIError(400, f"the request body nests arrays and objects more than {max_depth} deep",
                               param=where or None)
            if isinstance(value, dict):
                for k, v in value.items():
                    _check_text(k, where)
                    stack.append((v, depth + 1, f"{where}.{k}" if where else k))
            else:
                stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = where if len(where) <= 200 else where[:200] + "..."
        name = where or "the request body"
        raise APIError(400, f"{name} is not valid UTF-8 text ({e.reason} at index {e.start})",
                       param=where or None) from None
