"""The `spec-runtime` command: `generate`, `serve`, `bench`.

Model, speculation, scheduler and runtime flags are generated from the config
dataclasses (spec_runtime.cli_flags), so `--help` always matches what the runtime
accepts. Every flag is checked before any process starts: each problem is printed on
a line of its own and the exit code is 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from spec_runtime.cli_config import apply_speculative_config, expand_config_file, resolve_model_ids
from spec_runtime.cli_flags import (
    ConfigErrors,
    add_config_flags,
    add_sampling_flags,
    config_from_args,
    preflight,
    sampling_from_args,
)

__all__ = ["add_config_flags", "build_parser", "config_from_args", "main"]


def _checked_config(args: argparse.Namespace, sampling: bool = False, local: bool = True):
    """(config, SamplingParams or None) from the flags; ConfigErrors lists every problem."""
    errors: list[str] = []
    cfg = sp = None
    try:
        cfg = config_from_args(args)
    except ConfigErrors as e:
        errors += e.errors
    if sampling:
        try:
            sp = sampling_from_args(args)
        except ConfigErrors as e:
            errors += e.errors
    if local:
        given = vars(args)
        roles = ["target"]
        if cfg is not None and cfg.spec.uses_draft_process or cfg is None and given.get("spec.mode") != "ar":
            roles.append("draft")
        args.hf_ids, hf_errors = resolve_model_ids(args, roles)  # org/name -> its cached snapshot
        errors += hf_errors
        if args.hf_ids and cfg is not None:
            cfg = config_from_args(args)
        roles = [r for r in roles if not any(line.startswith(f"--{r} ") for line in hf_errors)]
        try:
            preflight({r: given.get(f"{r}.path", "") for r in roles},
                      {r: given.get(f"{r}.device", "cpu") for r in roles})
        except ConfigErrors as e:
            errors += e.errors
    if errors:
        raise ConfigErrors(errors)
    return cfg, sp


def _summary(cfg, st: dict, finish_reason) -> str:
    """The one-line result the CLI prints after the text (docs/metrics.md defines each figure)."""
    head = f"{st['num_generated_tokens']} tokens in {st['e2e_s']:.2f} s"
    if cfg.spec.mode == "ar":
        return f"[ar] {head}; finish: {finish_reason}"
    per = ", ".join(f"{x:.2f}" for x in st["acceptance_per_position"])
    return (f"[{cfg.spec.mode}, draft {cfg.draft_name}, K={cfg.spec.k}] {head}; {st['num_rounds']} rounds, "
            f"{st['num_drafts']} with a draft; acceptance length {st['mean_acceptance_length']:.2f} "
            f"(1 + accepted/drafts), acceptance rate {st['acceptance_rate']:.2f}, per position [{per}]; "
            f"finish: {finish_reason}")


def _cap_max_tokens(sp, num_prompt_tokens: int, max_model_len: int):
    """vLLM's rule: a max_tokens beyond the context is capped, with a warning."""
    import msgspec

    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ConfigErrors([f"the prompt ({num_prompt_tokens} tokens) fills the context ({max_model_len} tokens); "
                            f"raise --max-model-len or shorten the prompt"])
    if sp.max_tokens > room:
        print(f"spec-runtime: warning: --max-tokens {sp.max_tokens} is more than the context leaves "
              f"({max_model_len} - {num_prompt_tokens} prompt tokens); generating at most {room}", file=sys.stderr)
        sp = msgspec.structs.replace(sp, max_tokens=room)
    return sp


def _generate(args: argparse.Namespace) -> int:
    cfg, sp = _checked_config(args, sampling=True)
    from concurrent.futures import ThreadPoolExecutor

    from spec_runtime.client import Client, GenerationResult
    from spec_runtime.launcher import StartupError, format_startup
    from spec_runtime.models.loader import load_tokenizer

    # The tokenizer loads here while the processes start.
    pool = ThreadPoolExecutor(1)
    tokenizer = pool.submit(load_tokenizer, cfg.target.path, cfg.target.gguf_cache)
    pool.shutdown(wait=False)
    try:
        client = Client(cfg, tokenizer=tokenizer)
    except StartupError as e:
        print(f"spec-runtime: start-up failed: {e}", file=sys.stderr)
        return 1
    with client:
        phases = client.launcher.startup_phases() if hasattr(client.launcher, "startup_phases") else {}
        chat = not args.raw and bool(getattr(client.tokenizer, "chat_template", None))
        prompt_ids = client.encode_prompt(args.prompt, chat=chat)
        sp = _cap_max_tokens(sp, len(prompt_ids), client.ready.max_model_len)
        if args.json:
            res = client.generate(prompt_ids, sp)
            print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                              "mode": cfg.spec.mode, "draft": cfg.draft_name if cfg.spec.mode != "ar" else None,
                              "k": cfg.spec.k if cfg.spec.mode != "ar" else None, "startup": phases,
                              "stats": res.stats_dict()}))
            return 0
        print(f"[start-up] {format_startup(phases)}", file=sys.stderr)
        final = None
        for out in client.stream(prompt_ids, sp):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            final = out
        sys.stdout.write("\n")
        if final is not None and final.stats is not None:
            st = GenerationResult("", [], final.finish_reason, final.stats).stats_dict()
            print(_summary(cfg, st, final.finish_reason), file=sys.stderr)
            if st["num_ar_fallback_rounds"] and cfg.spec.mode != "ar":
                print(f"spec-runtime: note: {st['num_ar_fallback_rounds']} rounds ran without speculation because "
                      f"the draft answered later than --draft-timeout-s; on a busy machine raise it "
                      f"(e.g. --draft-timeout-s 10)", file=sys.stderr)
    return 0


# Flags of `serve` that only the local server has, and why Ray Serve does without them.
_LOCAL_ONLY_FLAGS = {
    "on_target_death": "Ray Serve's health check replaces a replica whose target died",
    "uvicorn_log_level": "Ray Serve's proxy runs its own HTTP server (its logs are in the Ray logs)",
}
_RAY_FLAGS = ("ray_address", "ray_placement", "ray_gpus_per_actor", "ray_cpus_per_actor", "num_replicas",
              "max_replicas", "ray_placement_timeout_s")


def _check_ray_flags(args: argparse.Namespace) -> None:
    """Refuse, by name, a flag that the chosen server (local or --ray) would not honour."""
    if args.ray:
        from spec_runtime.server.app_options import PROXY_HTTP_FIELDS

        local_only = {**_LOCAL_ONLY_FLAGS, **{f"http.{k}": why for k, why in PROXY_HTTP_FIELDS.items()}}
        for name, why in local_only.items():
            if vars(args).get(name) is not None:
                raise ValueError(f"--{name.rpartition('.')[2].replace('_', '-')} does not apply with --ray: {why}")
    else:
        given = [n for n in _RAY_FLAGS if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --ray")


def _serve_ray(args: argparse.Namespace, cfg, options) -> int:
    """Target and draft as Ray actors in each replica's placement group, the API as a Ray Serve app."""
    from spec_runtime.launcher import StartupError
    from spec_runtime.ray import PlacementError
    from spec_runtime.ray.launch import run_ray_server

    try:
        return run_ray_server(
            cfg, options, host=args.host, port=args.port, address=args.ray_address,
            placement=args.ray_placement or "pack", gpus_per_actor=args.ray_gpus_per_actor,
            cpus_per_actor=args.ray_cpus_per_actor, num_replicas=args.num_replicas or 1,
            max_replicas=args.max_replicas, placement_timeout_s=args.ray_placement_timeout_s or 60.0)
    except PlacementError as e:
        print(f"spec-runtime: placement failed: {e}", file=sys.stderr)
        return 1
    except StartupError as e:
        print(f"spec-runtime: start-up failed: {e}", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace) -> int:
    if args.target_model is not None:
        if vars(args).get("target.path", args.target_model) != args.target_model:
            raise ValueError("give the target either as TARGET or as --target, not both")
        setattr(args, "target.path", args.target_model)
    if args.speculative_config:
        apply_speculative_config(args, args.speculative_config)
    if args.api_key is None and os.environ.get("SPEC_RUNTIME_API_KEY"):
        args.api_key = os.environ["SPEC_RUNTIME_API_KEY"]
    errors = []
    cfg = None
    if not 0 <= args.port <= 65535:
        errors.append(f"--port must be in [0, 65535], got {args.port}")
    try:
        _check_ray_flags(args)
    except ValueError as e:
        errors.append(str(e))
    try:
        cfg, _ = _checked_config(args, local=not args.ray)
    except ConfigErrors as e:
        errors = e.errors + errors
    options = None
    if cfg is not None:
        try:
            options = _app_options(args, cfg)
        except ConfigErrors as e:
            errors += e.errors
    if errors:
        raise ConfigErrors(errors)
    from spec_runtime.launcher import StartupError
    from spec_runtime.server.serve import run_server

    if args.ray:
        return _serve_ray(args, cfg, options)
    try:
        return run_server(cfg, options, host=args.host, port=args.port, log_level=args.uvicorn_log_level or "warning",
                          on_target_death=args.on_target_death or "exit")
    except StartupError as e:
        print(f"spec-runtime: start-up failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"spec-runtime: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1


def _app_options(args: argparse.Namespace, cfg):
    """The HTTP app's options from the flags (ConfigErrors naming each bad one). The
    model's generation_config.json is read here where the target is a directory on this
    host; else (a Ray cluster's path) each replica reads it. Says on stderr which request
    defaults apply, so none is applied silently."""
    from spec_runtime.server.app_options import app_options_from_args

    path = cfg.target.path
    local = os.path.isdir(path) or not args.ray
    # As vLLM names the model: the Hugging Face id given, not its cache path.
    name = getattr(args, "hf_ids", {}).get("target")
    options = app_options_from_args(args, path if local else None, served_model_name=name)
    if options.generation_defaults:
        print(f"spec-runtime: request defaults from the model's generation_config.json: "
              f"{', '.join(f'{k}={v}' for k, v in options.generation_defaults.items())} (a request's own value "
              f"wins; --generation-config none turns them off)", file=sys.stderr)
    return options


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                                       "/v1/models, /health, /metrics)")
    srv.add_argument("target_model", nargs="?", default=None, metavar="TARGET",
                     help="target model (same as --target)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--on-target-death", choices=["exit", "stay"], default=None,
                     help="if the target process dies: exit with code 1 so a supervisor restarts the server (exit), "
                          "or keep answering with /health 503 (stay) (default: exit; not with --ray)")
    ray = srv.add_argument_group("Ray (see docs/ray.md)")
    ray.add_argument("--ray", action="store_true",
                     help="run target and draft as Ray actors in each replica's placement group, behind a Ray Serve "
                          "app")
    ray.add_argument("--ray-address", default=None,
                     help="Ray cluster to join (e.g. auto, or HOST:6379); default: start a local one")
    ray.add_argument("--ray-placement", choices=["pack", "spread"], default=None,
                     help="a replica's bundles on one node (pack) or on different nodes (spread) (default: pack)")
    ray.add_argument("--ray-gpus-per-actor", type=float, default=None,
                     help="GPUs of the target actor and of the draft actor (default: 1, or 0 with a warning where "
                          "the cluster has no GPUs)")
    ray.add_argument("--ray-cpus-per-actor", type=float, default=None,
                     help="CPUs of the target actor and of the draft actor (default: 1, less where one replica "
                          "would not fit in the cluster's CPUs)")
    ray.add_argument("--num-replicas", type=int, default=None, help="Serve replicas, each with its own target and "
                                                                      "draft (default: 1)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscale between --num-replicas and this many replicas (Serve's autoscaling_config)")
    ray.add_argument("--ray-placement-timeout-s", type=float, default=None,
                     help="give up when the replicas' bundles cannot be reserved in this many seconds (default: 60)")
    srv.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default: 8000)")
    srv.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="SpeculativeConfig fields as JSON, e.g. '{\"mode\": \"ssd\", \"k\": 4}', or vLLM's keys "
                          "(method: draft_model or ngram, model, num_speculative_tokens, prompt_lookup_max, "
                          "prompt_lookup_min); unknown keys are errors")
    _add_config_file_flag(srv)
    srv.add_argument("--uvicorn-log-level", default=None, help="uvicorn's log level (default: warning; not with --ray)")
    from spec_runtime.server.app_options import add_app_flags

    add_app_flags(srv)
    add_config_flags(srv)
    srv.set_defaults(func=_serve)


def _add_bench(sub) -> None:
    from spec_runtime import bench_serving

    b = sub.add_parser("bench", help="load-test a running server and report latency and speculation stats")
    bench_serving.add_bench_args(b)
    b.set_defaults(func=bench_serving.run_from_args)


def _add_config_file_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="flags from a YAML file, keys named as the flags (max-num-seqs: 8; model: PATH); "
                             "flags given on the command line win; unknown keys are errors (default: none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spec-runtime", description="Exact speculative decoding (AR / SD / SSD).")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print it with speculation stats")
    gen.add_argument("prompt", help="the prompt (chat-templated when the model has a template, unless --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, finish_reason, startup (seconds per start-up "
                          "phase) and stats (docs/metrics.md)")
    add_sampling_flags(gen)
    _add_config_file_flag(gen)
    add_config_flags(gen, defaults={"sched.max_batch_size": 1})  # one prompt: one KV slot
    gen.set_defaults(func=_generate)
    _add_serve(sub)
    _add_bench(sub)
    from spec_runtime.distill.cli import add_distill_parser, add_export_parser

    add_distill_parser(sub)
    add_export_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    try:
        argv = expand_config_file({c: sub.choices[c] for c in ("generate", "serve")}, argv)
    except ValueError as e:
        print(f"spec-runtime {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigErrors as e:
        for line in e.errors:
            print(f"spec-runtime {args.command}: error: {line}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"spec-runtime {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
