"""A converted copy of each GGUF file, so only the first load pays for de-quantization.

transformers de-quantizes a GGUF file into float32 tensors, which takes most of a
start-up on a CPU. The first load of a file writes the result as a Hugging Face
directory (config.json, model.safetensors, tokenizer files) under

    $XDG_CACHE_HOME/spec-runtime/gguf/<key>/     (~/.cache when XDG_CACHE_HOME is unset)

and every later load reads that directory instead, through the same safetensors path
as any HF checkpoint. The tensors are the de-quantized float32 values themselves, so a
cached load gives bit-identical weights.

The key is a SHA-256 over the file's size, its modification time (ns), its first and
last MiB, the cache format version and the transformers version (which does the
de-quantization). Hashing the whole file would cost seconds for a large model on every
start; a file rewritten in place keeps its key only if it keeps its size and mtime and
both ends, which no real edit of a GGUF file does. Delete the directory to rebuild it.

A directory is published by an atomic rename once complete, so concurrent loads of the
same file (target and draft at once) never read a half-written copy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
_EDGE_BYTES = 1 << 20
_COMPLETE = "spec_runtime_cache.json"


def cache_root() -> str:
    """$XDG_CACHE_HOME/spec-runtime/gguf, or ~/.cache/spec-runtime/gguf."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spec-runtime", "gguf")


def file_key(path: str) -> str:
    """A cheap content key of `path` (see the module docstring for what it covers)."""
    import transformers

    st = os.stat(path)
    h = hashlib.sha256(f"{CACHE_FORMAT}|{transformers.__version__}|{st.st_size}|{st.st_mtime_ns}|".encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE_BYTES))
        if st.st_size > _EDGE_BYTES:
            f.seek(max(_EDGE_BYTES, st.st_size - _EDGE_BYTES))
            h.update(f.read(_EDGE_BYTES))
    return h.hexdigest()[:32]


def cache_dir_for(gguf_path: str) -> str:
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(cache_root(), f"{stem}-{file_key(gguf_path)}")


def lookup(gguf_path: str) -> str | None:
    """The converted directory of `gguf_path`, or None if it has not been converted."""
    try:
        d = cache_dir_for(gguf_path)
    except OSError:
        return None
    return d if os.path.isfile(os.path.join(d, _COMPLETE)) else None


def store(gguf_path: str, config, state: dict, tokenizer) -> str | None:
    """Write the de-quantized model as a HF directory; returns it, or None (logged) if the
    cache cannot be written (read-only home, full disk): loading goes on without it."""
    import json

    import torch
    from safetensors.torch import save_file

    final = cache_dir_for(gguf_path)
    root = os.path.dirname(final)
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        tensors = {}
        seen: dict[int, str] = {}
        for name, t in state.items():
            if "rotary_emb.inv_freq" in name:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # a tied head shares the embedding's storage: store it once
                if name == "lm_head.weight":
                    continue
                t = t.clone()
            seen.setdefault(ptr, name)
            tensors[name] = t.detach().to(torch.float32).contiguous()
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, _COMPLETE), "w") as f:
            json.dump({"source": os.path.abspath(gguf_path), "format": CACHE_FORMAT}, f)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, _COMPLETE)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process published it first
        tmp = None
        logger.info("cached the converted %s in %s", os.path.basename(gguf_path), final)
        return final
    except OSError as e:
        logger.warning("could not cache the converted %s under %s (%s); the next start converts it again",
                       os.path.basename(gguf_path), root, e)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
