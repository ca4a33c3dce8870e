"""What `spec-runtime serve` gives the HTTP app beyond the RuntimeConfig: `AppOptions`.

One set of flags builds it (`add_app_flags`, `app_options_from_args`), for the local
server (spec_runtime.server.serve) and for every Ray Serve replica
(spec_runtime.ray.serve_app) alike, so both honour the same flags:

  --served-model-name, --api-key, --max-body-bytes, the HTTP limits (HTTPConfig),
  --metrics-prefix, --generation-config, --chat-template, --tool-call-parser (ChatConfig).

A Ray replica may run on another node than the command: `portable()` carries the chat
template as text, and the model's generation_config.json is read where the model is
(`generation_defaults(model_path)`) when the command could not read it itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from dataclasses import dataclass, field

from spec_runtime.server.chat_config import ChatConfig
from spec_runtime.server.generation_config import CHOICES as GENERATION_CONFIG_CHOICES
from spec_runtime.server.generation_config import load_generation_defaults
from spec_runtime.server.http_limits import HTTPConfig

logger = logging.getLogger(__name__)

METRICS_PREFIXES = ("spec_runtime", "vllm")  # spec_runtime.server.metrics.PREFIXES
# HTTPConfig fields that only the local server's uvicorn applies: under Ray Serve its
# proxy reads request heads and holds connections, so they are refused there by name.
PROXY_HTTP_FIELDS = {
    "header_timeout_s": "Ray Serve's proxy reads the request head (its own HTTP server)",
    "keep_alive_timeout_s": "Ray Serve's proxy holds the connections (its own HTTP server)",
    "max_header_bytes": "Ray Serve's proxy reads the request head (its own HTTP server)",
}


@dataclass(frozen=True)
class AppOptions:
    """The HTTP app's settings: name, key, limits, metrics names, request defaults, chat."""

    served_model_name: str | None = None  # None: model_name_of(cfg), the target path
    api_key: str | None = None
    http: HTTPConfig = field(default_factory=HTTPConfig)
    metrics_prefix: str = "spec_runtime"
    generation_config: str = "auto"
    # The sampling defaults --generation-config gives; None: not read yet (read from the
    # model's directory where the app is built).
    generation_defaults: dict[str, float] | None = None
    chat: ChatConfig = field(default_factory=ChatConfig)

    def __post_init__(self) -> None:
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {', '.join(METRICS_PREFIXES)}, got "
                             f"{self.metrics_prefix!r}")
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_CHOICES)}, got "
                             f"{self.generation_config!r}")

    def generation_defaults_for(self, model_path: str) -> dict[str, float]:
        """The request defaults: those read by the command, else read from model_path."""
        if self.generation_defaults is not None:
            return dict(self.generation_defaults)
        defaults = load_generation_defaults(self.generation_config, model_path)
        if defaults:
            logger.info("request defaults from %s/generation_config.json: %s", model_path, defaults)
        return defaults

    def app_kwargs(self, model_path: str) -> dict:
        """Keyword arguments of server.app.build_app."""
        return dict(served_model_name=self.served_model_name, api_key=self.api_key, http=self.http,
                    metrics_prefix=self.metrics_prefix, generation_defaults=self.generation_defaults_for(model_path),
                    chat=self.chat)

    def portable(self) -> "AppOptions":
        """The same options with the chat template as its text (a file given on this host
        need not exist where a Ray replica runs)."""
        return dataclasses.replace(self, chat=dataclasses.replace(self.chat, chat_template=self.chat.template_text()))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AppOptions":
        d = dict(d)
        return cls(**{**d, "http": HTTPConfig(**d["http"]), "chat": ChatConfig(**d["chat"])})


def _add_dataclass_flags(parser: argparse.ArgumentParser, title: str, cls, prefix: str, skip=()) -> None:
    from spec_runtime.cli_flags import _add_field

    g = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            _add_field(g, f"--{f.name.replace('_', '-')}", f"{prefix}.{f.name}", hints[f.name],
                       f.metadata.get("help", ""), str(f.default), argparse.SUPPRESS)


def add_app_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of AppOptions (unset ones stay out of the namespace, or None)."""
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPEC_RUNTIME_API_KEY, else none)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: the target path, or the Hugging Face id given)")
    parser.add_argument("--generation-config", choices=list(GENERATION_CONFIG_CHOICES), default=None,
                        help="auto: the model's generation_config.json sampling values (temperature, top_p, top_k, "
                             "repetition_penalty, min_p) are request defaults that a request's own fields override; "
                             "vllm or none: the API's own defaults (default: auto)")
    parser.add_argument("--metrics-prefix", choices=list(METRICS_PREFIXES), default=None,
                        help="prefix of the /metrics names: vllm makes them vllm:..., so vLLM's dashboards and "
                             "`vllm bench serve` read them unchanged (default: spec_runtime)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="larger request bodies get HTTP 413 (default: 1 MiB)")
    _add_dataclass_flags(parser, "HTTP limits", HTTPConfig, "http", skip=("max_body_bytes",))
    _add_dataclass_flags(parser, "chat", ChatConfig, "chat")


def app_options_from_args(args: argparse.Namespace, model_path: str | None,
                          served_model_name: str | None = None) -> AppOptions:
    """AppOptions of the flags; ConfigErrors naming each bad flag. model_path: where this
    process reads generation_config.json (None: the model is not on this host; the app
    reads it where it is built). served_model_name: the default name (e.g. the Hugging
    Face id the target was given as)."""
    from spec_runtime.cli_flags import ConfigErrors

    given = vars(args)
    errors: list[str] = []

    def sub(prefix: str, cls):
        kw = {name[len(prefix) + 1:]: v for name, v in given.items() if name.startswith(prefix + ".")}
        if prefix == "http" and given.get("max_body_bytes") is not None:
            kw["max_body_bytes"] = given["max_body_bytes"]
        try:
            return cls(**kw)
        except ValueError as e:  # "field_name ...": name the flag
            name, _, rest = str(e).partition(" ")
            errors.append(f"--{name.replace('_', '-')} {rest}")
            return None

    http, chat = sub("http", HTTPConfig), sub("chat", ChatConfig)
    mode = given.get("generation_config") or "auto"
    defaults = None
    if model_path is not None:
        try:
            defaults = load_generation_defaults(mode, model_path)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ConfigErrors(errors)
    return AppOptions(served_model_name=given.get("served_model_name") or served_model_name,
                      api_key=given.get("api_key"), http=http, metrics_prefix=given.get("metrics_prefix") or
                      "spec_runtime", generation_config=mode, generation_defaults=defaults, chat=chat)
