"""The `spec-runtime` command.

Flags are generated from the config dataclasses (spec_runtime.config), so `--help`
always matches what the runtime accepts:
  ModelConfig fields      -> --target, --target-device, ... and --draft, --draft-device, ...
  SpeculativeConfig       -> --mode, --k, --fan-out, --backup, ...
  SchedulerConfig         -> --max-batch-size, --max-model-len, ...
  RuntimeConfig (scalars) -> --seed, --startup-timeout-s, --log-level
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any, get_args, get_origin

from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig


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


def _add_field(group, flag: str, dest: str, f: dataclasses.Field, hint: Any) -> None:
    help_text = f.metadata.get("help", "")
    default = f.default
    kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": f"{help_text} (default: {default!r})"}
    origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif origin is typing.Literal:
        kw["choices"] = list(args)
    elif origin is tuple:
        kw["type"] = _parse_tuple(args[0])
        kw["metavar"] = "A,B,..."
    elif hint in (int, float, str):
        kw["type"] = hint
    elif type(None) in args:  # X | None
        inner = next(a for a in args if a is not type(None))
        kw["type"] = inner
    else:
        kw["type"] = str
    group.add_argument(flag, **kw)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    def fields(cls):
        hints = typing.get_type_hints(cls)
        return [(f, hints[f.name]) for f in dataclasses.fields(cls)]

    for role in ("target", "draft"):
        g = parser.add_argument_group(f"{role} model")
        for f, hint in fields(ModelConfig):
            flag = f"--{role}" if f.name == "path" else f"--{role}-{f.name.replace('_', '-')}"
            _add_field(g, flag, f"{role}.{f.name}", f, hint)
    for cls, section, title in ((SpeculativeConfig, "spec", "speculation"), (SchedulerConfig, "sched", "scheduler")):
        g = parser.add_argument_group(title)
        for f, hint in fields(cls):
            _add_field(g, f"--{f.name.replace('_', '-')}", f"{section}.{f.name}", f, hint)
    g = parser.add_argument_group("runtime")
    for f, hint in fields(RuntimeConfig):
        if f.name not in ("target", "draft", "spec", "sched"):
            _add_field(g, f"--{f.name.replace('_', '-')}", f"runtime.{f.name}", f, hint)


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """Build the frozen config tree from the flags that were given; ValueError if invalid."""
    given: dict[str, dict[str, Any]] = {"target": {}, "draft": {}, "spec": {}, "sched": {}, "runtime": {}}
    for dest, value in vars(args).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            given[section][name] = value
    return RuntimeConfig(
        target=ModelConfig(**given["target"]),
        draft=ModelConfig(**given["draft"]),
        spec=SpeculativeConfig(**given["spec"]),
        sched=SchedulerConfig(**given["sched"]),
        **given["runtime"],
    )


def _generate(args: argparse.Namespace) -> int:
    from protocol.messages import SamplingParams
    from spec_runtime.client import Client
    from spec_runtime.launcher import StartupError

    cfg = config_from_args(args)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.request_seed, stop=args.stop or [])
    try:
        client = Client(cfg)
    except StartupError as e:
        print(f"spec-runtime: start-up failed: {e}", file=sys.stderr)
        return 1
    with client:
        chat = not args.raw and bool(getattr(client.tokenizer, "chat_template", None))
        prompt_ids = client.encode_prompt(args.prompt, chat=chat)
        if args.json:
            res = client.generate(prompt_ids, sp)
            print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                              "mode": cfg.spec.mode, "draft": cfg.draft_name if cfg.spec.mode != "ar" else None,
                              "k": cfg.spec.k, "stats": res.stats_dict()}))
            return 0
        final = None
        for out in client.stream(prompt_ids, sp):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            final = out
        sys.stdout.write("\n")
        if final is not None and final.stats is not None:
            from spec_runtime.client import GenerationResult

            st = GenerationResult("", [], final.finish_reason, final.stats).stats_dict()
            draft = f", draft {cfg.draft_name}" if cfg.spec.mode != "ar" else ""
            print(
                f"[{cfg.spec.mode}{draft}, K={cfg.spec.k}] {st['num_generated_tokens']} tokens in {st['e2e_s']:.2f} s, "
                f"{st['num_rounds']} rounds, {st['mean_accepted_tokens_per_round']:.2f} tokens/round, "
                f"acceptance {st['acceptance_rate']:.2f} per position {st['acceptance_per_position']}, "
                f"finish: {final.finish_reason}",
                file=sys.stderr,
            )
    return 0


def _apply_speculative_config(args: argparse.Namespace, text: str) -> None:
    """Merge --speculative-config JSON into the spec.* flags; unknown keys and conflicts are errors."""
    try:
        given = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(given, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
    for key, value in given.items():
        dest = f"spec.{key}"
        if isinstance(value, list):
            value = tuple(value)
        if dest in vars(args) and getattr(args, dest) != value:
            raise ValueError(f"--speculative-config sets {key}={value!r} but a flag sets it to {getattr(args, dest)!r}")
        setattr(args, dest, value)


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
        for name, why in _LOCAL_ONLY_FLAGS.items():
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} does not apply with --ray: {why}")
        http = sorted(n for n in vars(args) if n.startswith("http_"))  # given HTTP limits only
        if http:
            raise ValueError(f"--{http[0][len('http_'):].replace('_', '-')} does not apply with --ray: Ray Serve's "
                             "proxy runs its own HTTP server")
    else:
        given = [n for n in _RAY_FLAGS if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --ray")


def _serve_ray(args: argparse.Namespace, cfg) -> int:
    """Target and draft as Ray actors in each replica's placement group, the API as a Ray Serve app."""
    from spec_runtime.launcher import StartupError
    from spec_runtime.ray import PlacementError
    from spec_runtime.ray.launch import run_ray_server

    try:
        return run_ray_server(
            cfg, host=args.host, port=args.port, address=args.ray_address, placement=args.ray_placement or "pack",
            gpus_per_actor=args.ray_gpus_per_actor, cpus_per_actor=args.ray_cpus_per_actor,
            num_replicas=args.num_replicas or 1, max_replicas=args.max_replicas,
            placement_timeout_s=args.ray_placement_timeout_s or 60.0, api_key=args.api_key,
            served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes)
    except PlacementError as e:
        print(f"spec-runtime: placement failed: {e}", file=sys.stderr)
        return 1
    except StartupError as e:
        print(f"spec-runtime: start-up failed: {e}", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace) -> int:
    from spec_runtime.launcher import StartupError
    from spec_runtime.server.serve import run_server

    if args.target_model is not None:
        if vars(args).get("target.path", args.target_model) != args.target_model:
            raise ValueError("give the target either as TARGET or as --target, not both")
        setattr(args, "target.path", args.target_model)
    if args.speculative_config:
        _apply_speculative_config(args, args.speculative_config)
    cfg = config_from_args(args)
    _check_ray_flags(args)
    if args.ray:
        return _serve_ray(args, cfg)
    try:
        return run_server(cfg, host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                          log_level=args.uvicorn_log_level or "warning",
                          on_target_death=args.on_target_death or "exit", http=_http_config(args))
    except StartupError as e:
        print(f"spec-runtime: start-up failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"spec-runtime: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1


def _http_config(args: argparse.Namespace):
    from spec_runtime.server.http_limits import HTTPConfig

    given = {name[len("http_"):]: v for name, v in vars(args).items() if name.startswith("http_")}
    return HTTPConfig(**given)


def _add_http_flags(parser: argparse.ArgumentParser) -> None:
    from spec_runtime.server.http_limits import HTTPConfig

    g = parser.add_argument_group("HTTP limits")
    hints = typing.get_type_hints(HTTPConfig)
    for f in dataclasses.fields(HTTPConfig):
        if f.name != "max_body_bytes":  # --max-body-bytes is a serve flag of its own
            _add_field(g, f"--{f.name.replace('_', '-')}", f"http_{f.name}", f, hints[f.name])


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
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--served-model-name", default=None, help="model name clients send (default: the target path)")
    srv.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="SpeculativeConfig fields as JSON, e.g. '{\"mode\": \"ssd\", \"k\": 4}'; unknown keys are errors")
    srv.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get HTTP 413 (default: 1 MiB)")
    srv.add_argument("--uvicorn-log-level", default=None, help="uvicorn's log level (default: warning; not with --ray)")
    _add_http_flags(srv)
    add_config_flags(srv)
    srv.set_defaults(func=_serve)


def _add_bench(sub) -> None:
    from spec_runtime import bench_serving

    b = sub.add_parser("bench", help="load-test a running server and report latency and speculation stats")
    bench_serving.add_bench_args(b)
    b.set_defaults(func=bench_serving.run_from_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spec-runtime", description="Exact speculative decoding (AR / SD / SSD).")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print it with speculation stats")
    gen.add_argument("prompt", help="the prompt (chat-templated when the model has a template, unless --raw)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--request-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    add_config_flags(gen)
    gen.set_defaults(func=_generate)
    _add_serve(sub)
    _add_bench(sub)
    from spec_runtime.distill.cli import add_distill_parser

    add_distill_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"spec-runtime: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
