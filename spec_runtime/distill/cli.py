"""Flags of `spec-runtime distill`, generated from DistillConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import typing

from spec_runtime.distill.config import DistillConfig

_HELP = {
    "num_layers": "draft depth (default: a tenth of the target's, at least 1)",
    "hidden_size": "draft width, a multiple of the target's head size (default: the width that makes "
                   "the draft about 1/10 of the target's parameters)",
    "intermediate_size": "draft MLP width (default: the target's ratio to hidden_size)",
    "prompts": "file with one prompt per line (default: the prompt set shipped with spec-runtime)",
    "num_prompts": "use only the first N prompts (0 = all)",
    "self_prompts": "add N prompts the target writes itself (user turns sampled at temperature 1): "
                    "more varied teacher data than a fixed prompt set",
    "max_new_tokens": "tokens the target generates per prompt",
    "samples_per_prompt": "continuations per prompt: the first greedy, the others sampled at --gen-temperature",
    "gen_temperature": "temperature of the sampled continuations",
    "gen_batch_size": "prompts per generation batch",
    "top_k_logits": "target log-probs kept per position (the KL is taken over them)",
    "held_out_fraction": "fraction of prompts held out to measure acceptance",
    "steps": "optimizer steps",
    "batch_size": "sequences per step",
    "lr": "peak learning rate (AdamW, cosine schedule)",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "eval_every": "measure held-out acceptance every N steps",
    "save_every": "write a checkpoint every N steps",
    "device": "cuda, cuda:N or cpu (default: cuda if available)",
    "seed": "seed of initialisation, sampling and data order",
    "resume": "continue the run in --out from its teacher data and last checkpoint",
    "gguf": "also write the draft as this .gguf file, with the target's tokenizer (see export-gguf)",
    "gguf_type": "tensor type of the --gguf file's matrices: q8_0 or q5_1 (F16 where a row is not a multiple "
                 "of 32 long), f16 or f32; norms are always F32",
}


def add_distill_parser(sub) -> None:
    p = sub.add_parser("distill", help="train a small draft model for a target by distillation",
                       description="Train a draft for TARGET on the target's own continuations of a prompt set "
                                   "(forward KL on its top-k log-probs) and write a Hugging Face directory "
                                   "that `--draft DIR` loads.")
    p.add_argument("target_model", metavar="TARGET", nargs="?", default="",
                   help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)")
    hints = typing.get_type_hints(DistillConfig)
    for f in dataclasses.fields(DistillConfig):
        if f.name == "target":
            continue
        flag = f"--{f.name.replace('_', '-')}"
        kw = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.name == "out":
            p.add_argument(flag, required=True, metavar="DIR", help="directory the draft is written to", **kw)
        elif hints[f.name] is bool:
            p.add_argument(flag, action="store_true", help=_HELP[f.name], **kw)
        else:
            p.add_argument(flag, type=hints[f.name], help=f"{_HELP[f.name]} (default: {f.default!r})", **kw)
    p.set_defaults(func=run_from_args)


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    """The run's settings; with --resume, flags not given take the interrupted run's values."""
    names = {f.name for f in dataclasses.fields(DistillConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if args.target_model or not given.get("resume"):
        given["target"] = args.target_model
    saved_path = os.path.join(given["out"], ".distill", "config.json")
    if given.get("resume"):
        if not os.path.isfile(saved_path):
            raise ValueError(f"--resume: {given['out']!r} holds no distillation run to resume")
        with open(saved_path) as f:
            saved = {k: v for k, v in json.load(f).items() if k in names}
        cfg = DistillConfig(**{**saved, **given})
        cfg.check_resumable(saved)
        return cfg
    out = given["out"]
    if os.path.isdir(out) and os.listdir(out):
        hint = " (pass --resume to continue it)" if os.path.isfile(saved_path) else ""
        raise ValueError(f"--out {out!r} exists and is not empty{hint}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a directory")
    return DistillConfig(**given)


def run_from_args(args: argparse.Namespace) -> int:
    from spec_runtime.distill import distill

    cfg = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = distill(cfg)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "settings")}))
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser("export-gguf", help="write a draft directory as one quantized GGUF file",
                       description="Write a draft's Hugging Face directory (llama family) as one GGUF file, in "
                                   "llama.cpp's names and layout, that `--draft FILE` loads: Q8_0 matrices by default, the target's "
                                   "tokenizer (copied from its GGUF when it is one).")
    p.add_argument("draft_dir", metavar="DRAFT_DIR", help="the draft directory (`spec-runtime distill --out DIR`)")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="the file to write")
    p.add_argument("--gguf-type", default="q8_0", help=f"{_HELP['gguf_type']} (default: 'q8_0')")
    p.add_argument("--embedding-type", default="", help="tensor type of the token embedding (and a tied LM head): "
                   "q8_0, q5_1, f16 or f32 (default: --gguf-type). The shipped SmolLM2 draft uses q5_1 there")
    p.add_argument("--target", default=None, metavar="TARGET",
                   help="the draft's target, whose tokenizer the file carries: a .gguf file's tokenizer keys are "
                        "copied, a directory means the draft directory's own tokenizer (default: the target named "
                        "in DRAFT_DIR/distill.json, \"\" there being the embedded SmolLM2 GGUF)")
    p.set_defaults(func=export_from_args)


def export_from_args(args: argparse.Namespace) -> int:
    from spec_runtime.distill.export import export_gguf
    from spec_runtime.models.loader import default_model_path

    if not args.out.endswith(".gguf"):
        raise ValueError(f"--out must name a .gguf file, got {args.out!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    target = args.target
    if target == "":
        target = default_model_path()
    try:
        result = export_gguf(args.draft_dir, args.out, args.gguf_type, tokenizer_from=target or "",
                             embedding_type=args.embedding_type)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    print(json.dumps({"path": result.path, "bytes": result.num_bytes, "tensor_types": result.tensor_types,
                      "tokenizer_from": result.tokenizer_source}))
    return 0
