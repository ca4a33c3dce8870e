"""Random JSON schemas for the structured-output tests.

Every schema bounds its output (string lengths, array sizes, integer and number ranges,
few properties), so a greedy small model finishes it well inside the test's max_tokens,
and uses the keywords users send: object / array / string / integer / number / boolean /
null, enum, required, additionalProperties, anyOf, minLength / maxLength, minItems /
maxItems, minimum / maximum.
"""

from __future__ import annotations

import random

_WORDS = ["name", "age", "city", "id", "tags", "score", "active", "title", "items", "price", "color",
          "count", "kind", "note", "level", "owner", "size", "valid", "rank", "label"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties, nested at most two levels."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    props = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7] or [names[0]]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "null_or_int"]
    if depth < 3:
        kinds += ["array", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 10)}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "null_or_int":
        return {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}
    if kind == "array":
        lo = rng.randint(0, 2)
        item = _value(rng, 3)  # scalar items
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return random_schema(rng, depth)
