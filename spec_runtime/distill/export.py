"""Write a draft directory (config.json + safetensors) as one GGUF file.

The file is laid out as llama.cpp's converter lays out the llama family, which is what
transformers' GGUF reader (and so the runtime's loader) expects: the architecture keys
(`llama.*`), the tensors under llama.cpp's names (gguf's own name map) with the query
and key projections permuted into llama.cpp's rotary layout, and the tokenizer.

- Quantization (`q8_0`, the default): a matrix whose rows are a multiple of 32 values
  long is stored as Q8_0 (one float16 scale per 32 int8 values: 8.5 bits a weight), or
  with `q5_1` as Q5_1 (a float16 scale and minimum per 32 5-bit values: 6 bits a
  weight); other matrices as F16; norm weights and other vectors as F32, since they are
  tiny and sensitive. `f16` stores every matrix as F16, `f32` stores everything as F32.
  The token embedding (with a tied LM head, the largest matrix of a small draft) may
  take its own type: Q5_1 there and Q8_0 elsewhere keeps a SmolLM2 draft under 15 MB.
- Tokenizer: when the target is a GGUF file, its `tokenizer.*` keys (vocabulary,
  merges, token types, special ids, chat template) are copied unchanged, so the draft
  reads token ids exactly as the target does. Otherwise the draft directory's own
  Hugging Face tokenizer (byte-level BPE) is written as a `gpt2` vocabulary, with its
  merges, special ids and chat template from gguf's SpecialVocab.

A tied LM head is written once, as the embedding (`token_embd.weight`); a loader that
finds no `output.weight` ties the head to it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from spec_runtime.distill.config import GGUF_TYPES

logger = logging.getLogger(__name__)

_FAMILIES = ("llama", "mistral")  # model_type values written as llama.cpp's `llama` architecture
_BLOCK = 32  # values per Q8_0 / Q5_1 block


@dataclass(frozen=True)
class ExportResult:
    path: str
    num_bytes: int
    tensor_types: dict  # GGML type name -> number of tensors
    tokenizer_source: str


def _permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary layout (first half / second half of each head) -> llama.cpp's
    (interleaved pairs); transformers' GGUF loader applies the inverse."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_type(data: np.ndarray, gguf_type: str, gguf):
    q = gguf.GGMLQuantizationType
    if data.ndim == 1 or gguf_type == "f32":
        return q.F32
    if gguf_type in ("q8_0", "q5_1") and data.shape[-1] % _BLOCK == 0:
        return q.Q8_0 if gguf_type == "q8_0" else q.Q5_1
    return q.F16


def tokenizer_source(target: str) -> str:
    """The .gguf whose tokenizer keys a draft of `target` copies ("" = the embedded SmolLM2
    GGUF), or "" when the target is a directory (the draft's own tokenizer is written)."""
    from spec_runtime.models.loader import default_model_path

    path = target or default_model_path()
    if os.path.isdir(path):
        return ""
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        raise ValueError(f"tokenizer source {path!r} is neither a model directory nor a .gguf file")
    return path


def _distilled_target(draft_dir: str) -> str | None:
    """The target named in the directory's distill.json, or None without one."""
    info = os.path.join(draft_dir, "distill.json")
    if not os.path.isfile(info):
        return None
    with open(info) as f:
        return json.load(f).get("settings", {}).get("target")


def _copy_tokenizer_keys(writer, source: str, gguf) -> int:
    reader = gguf.GGUFReader(source)
    keys = [k for k in reader.fields if k.startswith("tokenizer.")]
    if not any(k == "tokenizer.ggml.tokens" for k in keys):
        raise ValueError(f"{source!r} holds no tokenizer (no tokenizer.ggml.tokens)")
    for key in keys:
        field = reader.fields[key]
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    return int(len(reader.fields["tokenizer.ggml.tokens"].data))


def _write_hf_tokenizer(writer, draft_dir: str, vocab_size: int, gguf) -> int:
    """A byte-level BPE tokenizer as llama.cpp's gpt2 vocabulary."""
    from transformers import AutoTokenizer

    path = os.path.join(draft_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"{draft_dir!r} has no tokenizer.json; pass the target's .gguf as the tokenizer source")
    with open(path, encoding="utf-8") as f:
        kind = json.load(f).get("model", {}).get("type")
    if kind != "BPE":
        raise ValueError(f"the draft's tokenizer is {kind}, not byte-level BPE; pass the target's .gguf as the "
                         "tokenizer source")
    tok = AutoTokenizer.from_pretrained(draft_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder  # id -> AddedToken
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(by_id)} but the draft only {vocab_size} embedding rows")
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(vocab_size):  # embedding rows without a token become unused padding
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(T.CONTROL if added[i].special else T.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(T.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(draft_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)
    return len(by_id)


def _write_arch_keys(writer, cfg, name: str, gguf_type: str, gguf) -> tuple[int, int]:
    """The `llama.*` architecture keys and the file type; (query heads, KV heads)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    ftype = gguf.LlamaFileType
    writer.add_file_type({"q8_0": ftype.MOSTLY_Q8_0, "q5_1": ftype.MOSTLY_Q5_1, "f16": ftype.MOSTLY_F16,
                          "f32": ftype.ALL_F32}[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return n_head, n_kv


def _check_draft_dir(draft_dir: str):
    """The directory's transformers config, after the checks the export needs."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(draft_dir, "config.json")):
        raise ValueError(f"{draft_dir!r} is not a model directory (no config.json)")
    cfg = AutoConfig.from_pretrained(draft_dir)
    if cfg.model_type not in _FAMILIES:
        raise ValueError(f"GGUF export writes the llama family ({', '.join(_FAMILIES)}); {draft_dir!r} is "
                         f"{cfg.model_type}: load the directory itself with --draft DIR")
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{draft_dir!r} scales its rotary embedding ({rope}), which the GGUF export does not "
                         "carry; load the directory itself with --draft DIR")
    if not any(f.endswith(".safetensors") for f in os.listdir(draft_dir)):
        raise ValueError(f"{draft_dir!r} has no safetensors weights")
    return cfg


def _write_tensors(writer, draft_dir: str, cfg, heads: tuple[int, int], gguf_type: str, embedding_type: str,
                   gguf) -> dict[str, int]:
    """Every weight under its llama.cpp name, rotary projections permuted; GGML type -> count."""
    from safetensors.numpy import load_file

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    counts: dict[str, int] = {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for file in sorted(f for f in os.listdir(draft_dir) if f.endswith(".safetensors")):
        for hf_name, data in load_file(os.path.join(draft_dir, file)).items():
            if "rotary_emb" in hf_name or (tied and hf_name == "lm_head.weight"):
                continue
            name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"{draft_dir!r}: no GGUF name for tensor {hf_name!r}")
            data = data.astype(np.float32)
            if hf_name.endswith("q_proj.weight"):
                data = _permute_rotary(data, heads[0])
            elif hf_name.endswith("k_proj.weight"):
                data = _permute_rotary(data, heads[1])
            kind = embedding_type if hf_name.endswith("embed_tokens.weight") else gguf_type
            qtype = _tensor_type(data, kind, gguf)
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
    return counts


def export_gguf(draft_dir: str, out_path: str, gguf_type: str = "q8_0", tokenizer_from: str = "",
                embedding_type: str = "") -> ExportResult:
    """Write `draft_dir` as `out_path`. tokenizer_from: the draft's target; a .gguf target's
    tokenizer keys are copied, a directory target means the draft directory's own tokenizer
    ("" = the target named in the directory's distill.json, else the directory's tokenizer).
    embedding_type: the token embedding's type (the tied LM head's too; "" = gguf_type)."""
    import gguf

    embedding_type = embedding_type or gguf_type
    for kind in (gguf_type, embedding_type):
        if kind not in GGUF_TYPES:
            raise ValueError(f"gguf type must be one of {', '.join(GGUF_TYPES)}, got {kind!r}")
    cfg = _check_draft_dir(draft_dir)
    if tokenizer_from:
        source = tokenizer_source(tokenizer_from)
    else:
        target = _distilled_target(draft_dir)
        source = "" if target is None else tokenizer_source(target)

    tmp = out_path + ".tmp"
    writer = gguf.GGUFWriter(tmp, "llama")
    heads = _write_arch_keys(writer, cfg, os.path.basename(os.path.normpath(draft_dir)), gguf_type, gguf)
    if source:
        num_tokens = _copy_tokenizer_keys(writer, source, gguf)
    else:
        num_tokens = _write_hf_tokenizer(writer, draft_dir, cfg.vocab_size, gguf)
    if num_tokens > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {num_tokens} tokens, the draft only {cfg.vocab_size} embedding rows")
    counts = _write_tensors(writer, draft_dir, cfg, heads, gguf_type, embedding_type, gguf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    os.replace(tmp, out_path)
    size = os.path.getsize(out_path)
    logger.info("wrote %s: %.1f MB, tensors %s, tokenizer from %s", out_path, size / 1e6, counts,
                source or "the draft directory")
    return ExportResult(out_path, size, counts, source or draft_dir)
