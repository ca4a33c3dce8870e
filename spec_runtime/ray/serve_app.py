"""The OpenAI-compatible HTTP API as a Ray Serve application.

Each replica deploys its own target and draft actors (spec_runtime.ray.deploy, from the
replica, so their placement group lives and dies with the replica) and serves the same
FastAPI app as `spec-runtime serve` (spec_runtime.server.app.build_app) through a
Client connected to them.

Health: Serve calls `check_health` every few seconds; it fails once the target is dead,
or once the draft is dead and the deployment has given up replacing it, and Serve then
replaces the whole replica (a fresh placement group, fresh actors). While a new draft is
being placed the replica stays healthy: requests decode without speculation meanwhile.
GET /health still answers 503 while any child is down, as locally.

    serve run spec_runtime.ray.serve_app:app_builder target=/models/llama-8b \\
        draft=/models/llama-1b mode=ssd target_device=cuda draft_device=cuda placement=spread

Keys of `app_builder` are the flags of `spec-runtime serve` without the dashes (dashes as
underscores), plus placement, gpus_per_actor, cpus_per_actor, placement_timeout_s.
"""

from __future__ import annotations

import argparse
import logging

from ray import serve

from protocol.codec import decode_config, encode_config
from spec_runtime.config import RuntimeConfig
from spec_runtime.ray.deploy import deploy

logger = logging.getLogger(__name__)

_DEPLOY_KEYS = {"placement": str, "gpus_per_actor": float, "cpus_per_actor": float, "placement_timeout_s": float}
_APP_KEYS = ("api_key", "served_model_name")


@serve.deployment(health_check_period_s=2.0, health_check_timeout_s=30.0)
@serve.ingress()
class SpecRuntimeServer:
    """One replica: a RayDeployment, an AsyncClient of it, and the FastAPI app."""

    def __init__(self, config: dict, deploy_kwargs: dict | None = None, api_key: str | None = None,
                 served_model_name: str | None = None):
        from spec_runtime.server.async_client import AsyncClient

        self._deployment = deploy(decode_config(config), **(deploy_kwargs or {}))
        self._client = AsyncClient(client=self._deployment.client())
        self._api_key = api_key
        self._served_model_name = served_model_name

    def __serve_build_asgi_app__(self):
        from spec_runtime.server.app import build_app

        return build_app(self._client, served_model_name=self._served_model_name, api_key=self._api_key)

    def check_health(self) -> None:
        dep = self._deployment
        if dep.dead_child() == "target":
            raise RuntimeError("the target actor is dead; this replica cannot serve")
        if dep.draft_given_up:
            raise RuntimeError("the draft actor is dead and could not be replaced")

    def __del__(self):
        client = getattr(self, "_client", None)
        if client is not None:
            client.client.close()  # also shuts the deployment down


def build_application(cfg: RuntimeConfig, *, placement: str = "pack", gpus_per_actor: float = 1.0,
                      cpus_per_actor: float = 1.0, placement_timeout_s: float = 60.0, api_key: str | None = None,
                      served_model_name: str | None = None, num_cpus: float = 0.0):
    """A bound Serve application (for `serve.run`). num_cpus: the replica's own CPUs (the
    actors' are in their bundles)."""
    deploy_kwargs = {"placement": placement, "gpus_per_actor": gpus_per_actor, "cpus_per_actor": cpus_per_actor,
                     "placement_timeout_s": placement_timeout_s}
    return SpecRuntimeServer.options(ray_actor_options={"num_cpus": num_cpus}).bind(
        encode_config(cfg), deploy_kwargs, api_key, served_model_name)


def app_builder(args: dict[str, str]):
    """`serve run spec_runtime.ray.serve_app:app_builder key=value ...` (see the module doc)."""
    from spec_runtime.cli import add_config_flags, config_from_args

    args = dict(args)
    deploy_kwargs = {k: conv(args.pop(k)) for k, conv in _DEPLOY_KEYS.items() if k in args}
    app_kwargs = {k: args.pop(k) for k in _APP_KEYS if k in args}
    parser = argparse.ArgumentParser(prog="app_builder", exit_on_error=False)
    add_config_flags(parser)
    argv = []
    for key, value in args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    try:
        cfg = config_from_args(parser.parse_args(argv))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"bad app_builder arguments {sorted(args)}: {e}") from None
    return build_application(cfg, **deploy_kwargs, **app_kwargs)


def run_ray_server(cfg: RuntimeConfig, *, host: str = "127.0.0.1", port: int = 8000, **kw) -> None:
    """Serve on Ray until interrupted: what `spec-runtime serve --ray` should call."""
    import ray

    if not ray.is_initialized():
        ray.init()
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(cfg, **kw), name="spec-runtime", route_prefix="/", blocking=True)
