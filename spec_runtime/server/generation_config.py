"""`serve --generation-config`: the model's generation_config.json sampling values as
request defaults, as vLLM applies them.

  auto  temperature, top_p, top_k, repetition_penalty and min_p from the model
        directory's generation_config.json become the defaults of every request; a
        field the request sets (not null) wins;
  vllm, none  the model's file is not read: the API's own defaults apply (vLLM's name
        for this is "vllm").

The file is read and checked before any process starts.
"""

from __future__ import annotations

import json
import os

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
CHOICES = ("auto", "vllm", "none")


def load_generation_defaults(mode: str, model_path: str) -> dict[str, float]:
    """The sampling defaults `mode` gives for the model at `model_path` ({} when none);
    ValueError naming the file for one that is not valid JSON or holds a bad value."""
    if mode not in CHOICES:
        raise ValueError(f"--generation-config must be one of {', '.join(CHOICES)}, got {mode!r}")
    if mode != "auto" or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config auto: cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--generation-config auto: {path} is not a JSON object")
    out: dict[str, float] = {}
    for key in SAMPLING_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"--generation-config auto: {path}: {key} must be a number, got {value!r}")
        out[key] = int(value) if key == "top_k" else float(value)
    if out:
        _check(out, path)
    return out


def _check(defaults: dict[str, float], path: str) -> None:
    from protocol.messages import SamplingParams
    from spec_runtime.validate import validate_sampling

    try:
        validate_sampling(SamplingParams(**defaults))
    except ValueError as e:
        raise ValueError(f"--generation-config auto: {path}: {e}") from None


def apply_generation_defaults(req, defaults: dict[str, float]):
    """`req` (a parsed request model) with each default filled in where the request left
    the field unset or null."""
    update = {k: v for k, v in defaults.items() if k in type(req).model_fields and getattr(req, k) is None}
    return req.model_copy(update=update) if update else req
