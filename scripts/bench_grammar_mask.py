"""Token-mask time of llguidance and xgrammar on CPU, with SmolLM2's tokenizer (49,152 tokens).

For each JSON schema below: the time to build a matcher (compile), then, along a valid
output (the schema's example, compact JSON, tokenized by the model's tokenizer, then
EOS), the time to compute each next-token mask and to advance by the token; "walk" is
all of it for one request (compile + every mask + every advance). Both libraries walk
the same tokens; compact separators (",", ":") and no free whitespace (xgrammar's
free-form object needs free whitespace to take compact separators). Every repeat
compiles afresh (no grammar cache).

    python scripts/bench_grammar_mask.py [--repeat 5] [--out bench/results/grammar_mask_cpu.json]

Needs both libraries: pip install llguidance xgrammar (xgrammar is not a dependency of
spec-runtime; it is measured here only).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}}, "required": ["id", "items", "status"],
        "additionalProperties": False},
        {"id": "ABC-1234", "items": [{"sku": "pen", "qty": 3, "price": 1.25}, {"sku": "ink", "qty": 1, "price": 7.5}],
         "status": "paid"}),
    "tool_call": ({"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"], "additionalProperties": False}}, "required": ["name", "parameters"],
         "additionalProperties": False},
        {"type": "object", "properties": {"name": {"enum": ["search"]}, "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
            "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}]}},
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}]),
    "nested_config": ({"type": "object", "properties": {
        "server": {"type": "object", "properties": {"host": {"type": "string"}, "port": {"type": "integer"},
                                                    "tls": {"type": "boolean"}},
                   "required": ["host", "port", "tls"], "additionalProperties": False},
        "workers": {"type": "integer"}, "mode": {"anyOf": [{"type": "null"}, {"enum": ["fast", "safe"]}]}},
        "required": ["server", "workers", "mode"], "additionalProperties": False},
        {"server": {"host": "localhost", "port": 8080, "tls": False}, "workers": 4, "mode": None}),
    "any_object": ({"type": "object"}, {"answer": "yes", "confidence": 0.9, "sources": [1, 2, 3]}),
}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _percentiles(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e6
    return {"mean_us": round(float(a.mean()), 1), "p50_us": round(float(np.percentile(a, 50)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1), "max_us": round(float(a.max()), 1), "n": len(xs)}


def bench_llguidance(tok, vocab: int, cases, repeat: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llg_np

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    init_s = time.perf_counter() - t0
    mask = llg_np.allocate_token_bitmask(1, vocab)
    compile_s, mask_s, advance_s, walk_s = [], [], [], []
    for schema, ids in cases:
        for _ in range(repeat):
            t0 = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            m = llguidance.LLMatcher(lt, grammar, log_level=0)
            compile_s.append(time.perf_counter() - t0)
            for t in ids:
                t0 = time.perf_counter()
                llg_np.fill_next_token_bitmask(m, mask, 0)
                t1 = time.perf_counter()
                assert (mask[0, t // 32] >> (t % 32)) & 1, f"llguidance refuses token {t}"
                assert m.consume_token(t), m.get_error()
                t2 = time.perf_counter()
                mask_s.append(t1 - t0)
                advance_s.append(t2 - t1)
            walk_s.append(compile_s[-1] + sum(mask_s[-len(ids):]) + sum(advance_s[-len(ids):]))
    return {"version": _version("llguidance"), "tokenizer_init_s":
            round(init_s, 3), "compile": _percentiles(compile_s), "mask": _percentiles(mask_s),
            "advance": _percentiles(advance_s), "walk": _percentiles(walk_s)}


def bench_xgrammar(tok, vocab: int, cases, repeat: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    init_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    compile_s, mask_s, advance_s, walk_s = [], [], [], []
    for schema, ids in cases:
        for _ in range(repeat):
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # each repeat compiles afresh
            t0 = time.perf_counter()
            # xgrammar's free-form object refuses compact separators unless whitespace is free.
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=schema == {"type": "object"},
                                                   separators=(",", ":"), strict_mode=False)
            m = xgr.GrammarMatcher(compiled)
            compile_s.append(time.perf_counter() - t0)
            for t in ids:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(mask, 0)
                t1 = time.perf_counter()
                assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"xgrammar refuses token {t}"
                assert m.accept_token(t)
                t2 = time.perf_counter()
                mask_s.append(t1 - t0)
                advance_s.append(t2 - t1)
            walk_s.append(compile_s[-1] + sum(mask_s[-len(ids):]) + sum(advance_s[-len(ids):]))
    return {"version": _version("xgrammar"), "tokenizer_init_s": round(init_s, 3), "compile": _percentiles(compile_s),
            "mask": _percentiles(mask_s), "advance": _percentiles(advance_s), "walk": _percentiles(walk_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="walks per schema (default: 5)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from spec_runtime.models.loader import load_tokenizer

    tok = load_tokenizer("")
    vocab = len(tok)
    cases = [(schema, tok.encode(json.dumps(example, separators=(",", ":"))) + [tok.eos_token_id])
             for schema, example in SCHEMAS.values()]
    result = {"tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab, "schemas": list(SCHEMAS),
              "tokens_per_walk": [len(ids) for _, ids in cases], "repeat": args.repeat,
              "cpu": platform.processor() or platform.machine(),
              "llguidance": bench_llguidance(tok, vocab, cases, args.repeat),
              "xgrammar": bench_xgrammar(tok, vocab, cases, args.repeat)}
    print(f"{'':12} {'init s':>8} {'compile p50 ms':>15} {'compile max ms':>15} {'mask mean us':>13} "
          f"{'mask p50 us':>12} {'mask p99 us':>12} {'advance mean us':>16} {'walk mean ms':>13}")
    for lib in ("llguidance", "xgrammar"):
        r = result[lib]
        print(f"{lib:12} {r['tokenizer_init_s']:8.2f} {r['compile']['p50_us'] / 1e3:15.2f} "
              f"{r['compile']['max_us'] / 1e3:15.2f} {r['mask']['mean_us']:13.1f} {r['mask']['p50_us']:12.1f} "
              f"{r['mask']['p99_us']:12.1f} {r['advance']['mean_us']:16.1f} {r['walk']['mean_us'] / 1e3:13.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
