"""Structured outputs on SmolLM2-135M-Instruct (the real GGUF), in ar, sd and ssd.

Random JSON schemas (tests/schema_util.py): every greedy output parses and validates
against its schema, and ar, sd (n-gram draft) and ssd (the draft shipped for SmolLM2,
unmasked, so the grammar rejects some of its tokens) give the same tokens. The SSD
tree holds two branches per sequence (a rejection of d_1 and a full accept): on two
CPU cores the draft's work-ahead competes with the target for the cores, and a larger
tree checks nothing more. The quick test takes a few schemas; the slow one takes 100 per
mode, among which every kind of value appears at least five times as a top-level property
and as a nested object's property, every scalar kind five times as an array's items, and
optional properties and arrays that may be empty as often. Also: the grammar's mask on
draft tokens (Grammars.bitmask), regex and choice constraints, and a sampled (T = 1) run.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import jsonschema
import msgspec
import pytest

from protocol.messages import SamplingParams, StructuredOutputs
from schema_util import random_schema
from spec_runtime.client import Client
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig, shipped_draft_path

MAX_TOKENS = 200
BATCH = 32  # requests decoded together in the mode comparisons: fewer forwards on the CPU


def _cfg(gguf: str, mode: str, draft: str = "", k: int = 4, batch: int = 8, **spec) -> RuntimeConfig:
    return RuntimeConfig(
        target=ModelConfig(path=gguf), draft=ModelConfig(path=draft),
        spec=SpeculativeConfig(mode=mode, k=k, draft_timeout_s=60.0, work_ahead="always", **spec),
        sched=SchedulerConfig(max_batch_size=batch, max_model_len=1024, spec_policy="always"), startup_timeout_s=300.0,
    )


def _modes(gguf: str) -> dict[str, RuntimeConfig]:
    return {"ar": _cfg(gguf, "ar", batch=BATCH), "sd": _cfg(gguf, "sd", "ngram", batch=BATCH),
            "ssd": _cfg(gguf, "ssd", shipped_draft_path(), batch=BATCH, fan_out=(1, 0, 0, 0, 1))}


def _run(cfg: RuntimeConfig, schemas: list[dict]) -> list[tuple[list[int], str, str]]:
    """(tokens, text, finish_reason) of a greedy request per schema, up to BATCH at a time."""
    with Client(cfg) as client:
        prompts = [client.encode_prompt(f"Reply with JSON for this schema: {json.dumps(s)}", chat=True)
                   for s in schemas]
        rids = [client.submit(p, SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutputs(
            kind="json_schema", spec=json.dumps(s)))) for p, s in zip(prompts, schemas)]
        results = [client._collect(r) for r in rids]
        totals = client.engine_stats().totals
    if cfg.spec.mode != "ar":
        assert totals.num_draft_tokens > 0
    return [(r.token_ids, r.text, r.finish_reason) for r in results]


def _check_modes(gguf: str, schemas: list[dict]) -> None:
    outputs = {mode: _run(cfg, schemas) for mode, cfg in _modes(gguf).items()}
    for schema, (tokens, text, reason) in zip(schemas, outputs["ar"]):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    for mode in ("sd", "ssd"):
        assert [o[0] for o in outputs[mode]] == [o[0] for o in outputs["ar"]], mode


def test_random_schemas_validate_and_agree_across_modes(smollm2_gguf_path):
    rng = random.Random(0)
    _check_modes(smollm2_gguf_path, [random_schema(rng) for _ in range(3)])


def _kind(value: dict) -> str:
    """schema_util's name for the kind of one value schema."""
    if "anyOf" in value:
        return "null_or_int"
    if "enum" in value:
        return "enum"
    return value["type"]


def _features(schema: dict, place: str = "top") -> set[tuple[str, str]]:
    """(kind, place) of every value in an object schema, place being "top" (a property of
    the schema itself), "nested" (a property of an object inside it) or "item" (an array's
    items); ("optional", place) where a property is not required; ("empty_ok", "array")
    where an array may be empty."""
    out = set()
    for name, value in schema["properties"].items():
        kind = _kind(value)
        out.add((kind, place))
        if name not in schema["required"]:
            out.add(("optional", place))
        if kind == "array":
            out.add((_kind(value["items"]), "item"))
            if value["minItems"] == 0:
                out.add(("empty_ok", "array"))
        elif kind == "object":
            out |= _features(value, "nested")
    return out


@pytest.mark.slow
def test_100_random_schemas_per_mode(smollm2_gguf_path):
    rng = random.Random(1)
    schemas = [random_schema(rng) for _ in range(100)]
    # Every kind of value the generator makes appears at least five times at the top level
    # and inside nested objects; every scalar kind at least five times as an array's items
    # (schema_util's arrays hold scalars); optional properties at both levels and arrays
    # that may be empty as often. No feature outside this list appears.
    scalars = ["string", "integer", "number", "boolean", "enum", "null_or_int"]
    wanted = ({(k, p) for k in scalars + ["array", "object", "optional"] for p in ("top", "nested")}
              | {(k, "item") for k in scalars} | {("empty_ok", "array")})
    counts = Counter(f for s in schemas for f in _features(s))
    assert {f for f in wanted if counts[f] < 5} == set(), counts
    assert set(counts) <= wanted, set(counts) - wanted
    _check_modes(smollm2_gguf_path, schemas)


@pytest.mark.slow
def test_regex_choice_and_sampled_json(smollm2_gguf_path):
    choices = ["Paris", "London", "Berlin"]
    with Client(_cfg(smollm2_gguf_path, "sd", smollm2_gguf_path)) as client:
        prompt = client.encode_prompt("What is the capital of France?", chat=True)
        r = client.generate(prompt, SamplingParams(max_tokens=20, structured=StructuredOutputs(
            kind="choice", spec=json.dumps(choices))))
        assert r.text in choices and r.finish_reason == "stop"
        r = client.generate(prompt, SamplingParams(max_tokens=30, structured=StructuredOutputs(
            kind="regex", spec=r"[A-Z][a-z]{1,12} is the capital\.")))
        assert r.text.endswith(" is the capital.") and r.finish_reason == "stop"
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
                  "required": ["city", "population"], "additionalProperties": False}
        sp = SamplingParams(max_tokens=60, temperature=1.0, structured=StructuredOutputs(
            kind="json_schema", spec=json.dumps(schema)))
        for seed in range(6):
            r = client.generate(prompt, msgspec.structs.replace(sp, seed=seed))
            assert r.finish_reason == "stop", r.text
            jsonschema.validate(json.loads(r.text), schema)


def test_bitmask_follows_the_valid_prefix_of_the_drafts(smollm2_gguf_path):
    from spec_runtime.models.loader import load_tokenizer
    from spec_runtime.structured import Grammars

    tok = load_tokenizer(smollm2_gguf_path)
    g = Grammars(tok, len(tok), [tok.eos_token_id])
    m = g.start(StructuredOutputs(kind="choice", spec=json.dumps(["yes", "no"])))
    (yes,) = tok.encode("yes")
    bad = tok.encode("maybe")[0]

    def allowed(bits, row, t):
        return bool((int(bits[row, t // 32]) >> (t % 32)) & 1)

    bits = g.bitmask([m, None], [[bad, yes], [bad]], 3)  # [2 * 3, W]
    assert allowed(bits, 0, yes) and not allowed(bits, 0, bad)
    # Slots past the first refused draft (and every slot of an unconstrained row) allow all.
    assert allowed(bits, 1, bad) and allowed(bits, 2, bad) and all(allowed(bits, r, bad) for r in (3, 4, 5))
    bits = g.bitmask([m], [[yes]], 2)
    assert not allowed(bits, 1, yes) and allowed(bits, 1, tok.eos_token_id)  # after "yes": only EOS
    # The masks were computed by walking ahead; nothing was committed.
    assert not g.complete(m) and g.commit(m, [yes]) and g.complete(m)
