"""What `spec-runtime generate|serve` takes in vLLM's terms, turned into its own flags
before anything else runs:

  --config FILE.yaml      keys are flag names (`max-num-seqs: 8`, `max_num_seqs: 8`, `model: ...`);
                          flags on the command line override the file; an unknown key is an error
  --speculative-config    vLLM's keys (method, model, num_speculative_tokens,
                          prompt_lookup_max/min) beside SpeculativeConfig's own
  a Hugging Face id       (`org/name`) as --target or --draft resolves to its snapshot in the
                          local Hugging Face cache, offline; nothing is downloaded

Every problem is a ValueError (or ConfigErrors) with one line naming the flag or key;
the CLI prints it and exits 2. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

from spec_runtime.config import NGRAM_DRAFT, SpeculativeConfig

# ---------------------------------------------------------------- --config FILE.yaml

_MODEL_KEYS = {"model": "--target"}  # vLLM's config files name the model `model`


def _option_index(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt[2:]] = action
    return out


def expand_config_file(subparsers: dict[str, argparse.ArgumentParser], argv: list[str]) -> list[str]:
    """argv with the --config file's settings inserted right after the command, so that
    flags given on the command line (parsed later) win. Unchanged when there is no --config."""
    if not argv or argv[0] not in subparsers:
        return argv
    path = None
    for i, tok in enumerate(argv):
        if tok == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif tok.startswith("--config="):
            path = tok.split("=", 1)[1]
    if path is None:
        return argv
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return argv
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flag names to values")
    options = _option_index(subparsers[argv[0]])
    tokens: list[str] = []
    unknown = []
    for raw_key, value in data.items():
        key = str(raw_key).replace("_", "-")
        flag = _MODEL_KEYS.get(key, f"--{key}")
        action = options.get(flag[2:])
        if action is None or key in ("config", "help"):
            unknown.append(str(raw_key))
            continue
        tokens += _tokens(flag, action, value, path)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; keys are the command's flag names without "
                         f"the leading -- (see spec-runtime {argv[0]} --help)")
    return [argv[0], *tokens, *argv[1:]]


def _tokens(flag: str, action: argparse.Action, value, path: str) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {flag[2:]} must be true or false, got {value!r}")
        return [flag] if value else ["--no-" + flag[2:]]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {flag[2:]} must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        return [t for v in values for t in (flag, str(v))]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        return [flag, ",".join(str(v) for v in value)]
    if isinstance(value, bool):
        return [flag, str(value).lower()]
    return [flag, str(value)]


# ---------------------------------------------------------------- --speculative-config

# vLLM's key -> this runtime's flag destination.
_VLLM_SPEC_KEYS = {"num_speculative_tokens": "spec.k", "prompt_lookup_max": "spec.ngram_max",
                   "prompt_lookup_min": "spec.ngram_min", "model": "draft.path"}
_METHODS = ("draft_model", "ngram")


def apply_speculative_config(args: argparse.Namespace, text: str) -> None:
    """Merge --speculative-config JSON into the flags (SpeculativeConfig's keys, and vLLM's);
    unknown keys, unsupported methods and conflicts with flags are errors."""
    try:
        given = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(given, dict):
        raise ValueError("--speculative-config must be a JSON object")
    own = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(given) - own - set(_VLLM_SPEC_KEYS) - {"method"})
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(own)}, and vLLM's "
                         f"{sorted([*_VLLM_SPEC_KEYS, 'method'])}")
    settings: dict[str, object] = {}
    method = given.get("method")
    if method is not None:
        if method not in _METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; spec-runtime speculates "
                             f"with a draft model (draft_model, with \"model\") or by prompt lookup (ngram)")
        if method == "ngram":
            if given.get("model") not in (None, "", NGRAM_DRAFT):
                raise ValueError("--speculative-config: method ngram takes no model")
            settings["draft.path"] = NGRAM_DRAFT
        elif not given.get("model") and vars(args).get("draft.path") in (None, "", NGRAM_DRAFT):
            raise ValueError("--speculative-config: method draft_model needs \"model\" (or --draft PATH)")
    for key, value in given.items():
        if key == "method":
            continue
        dest = _VLLM_SPEC_KEYS.get(key, f"spec.{key}")
        if isinstance(value, list):
            value = tuple(value)
        if dest in settings and settings[dest] != value:
            raise ValueError(f"--speculative-config sets {dest.split('.', 1)[1]} twice, to {settings[dest]!r} "
                             f"and {value!r}")
        settings[dest] = value
    for dest, value in settings.items():
        if dest in vars(args) and getattr(args, dest) != value:
            raise ValueError(f"--speculative-config sets {dest.split('.', 1)[1]}={value!r} but a flag sets it to "
                             f"{getattr(args, dest)!r}")
        setattr(args, dest, value)


# ---------------------------------------------------------------- Hugging Face ids

_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hf_id(path: str) -> bool:
    return bool(_HF_ID.fullmatch(path)) and not path.endswith(".gguf") and not os.path.exists(path)


def resolve_hf_id(role: str, repo_id: str) -> str:
    """The local snapshot directory of `repo_id` in the Hugging Face cache (offline);
    ValueError with one line where it is not there."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ValueError(f"--{role} {repo_id}: no such file or directory (and huggingface_hub, which would look "
                         f"it up in the Hugging Face cache, is not installed)") from None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), or a malformed id
        raise ValueError(f"--{role} {repo_id}: not a local path, and not in the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}); nothing is downloaded: fetch it first (huggingface-cli "
                         f"download {repo_id}) or pass a directory") from None


def resolve_model_ids(args: argparse.Namespace, roles: list[str]) -> tuple[dict[str, str], list[str]]:
    """Replace each role's Hugging Face id by its cached snapshot directory in `args`.
    Returns ({role: the id given}, [one error line per id not found])."""
    ids, errors = {}, []
    for role in roles:
        path = vars(args).get(f"{role}.path") or ""
        if not path or path == NGRAM_DRAFT or path.startswith("random:") or not looks_like_hf_id(path):
            continue
        try:
            setattr(args, f"{role}.path", resolve_hf_id(role, path))
            ids[role] = path
        except ValueError as e:
            errors.append(str(e))
    return ids, errors


def resolve_config_model_ids(cfg):
    """cfg with each model given as a Hugging Face id replaced by its snapshot directory in
    this host's cache (offline): where the models load on a Ray cluster, each node reads its
    own cache. ValueError naming the id where it is not cached here."""
    changes = {}
    for role in ("target", "draft"):
        model = getattr(cfg, role)
        path = model.path
        if path and path != NGRAM_DRAFT and not path.startswith("random:") and looks_like_hf_id(path):
            changes[role] = dataclasses.replace(model, path=resolve_hf_id(role, path))
    return cfg.replace(**changes) if changes else cfg
