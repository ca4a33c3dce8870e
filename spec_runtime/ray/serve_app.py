"""The OpenAI-compatible HTTP API as a Ray Serve application.

Serve reserves each replica's placement group before it starts the replica: one bundle
per process, the replica's own first (`{"CPU": replica_cpus}`), then the target's, then
the draft's (`{"GPU": gpus_per_actor, "CPU": cpus_per_actor}` each), under the deployment's
`placement_group_bundles` / `placement_group_strategy`. The replica starts its target and
draft actors in those bundles (spec_runtime.ray.deploy.deploy_in_current_group) and serves
the same FastAPI app as `spec-runtime serve` (spec_runtime.server.app.build_app) through a
Client connected to them. Replicas, autoscaling and replacement are Serve's.

Health: Serve calls `check_health` every few seconds; it fails once the target is dead,
or once the draft is dead and the deployment has given up replacing it, and Serve then
replaces the whole replica (a fresh placement group, fresh actors). While a new draft is
being placed the replica stays healthy: requests decode without speculation meanwhile.
GET /health answers as locally: 200 "degraded" while the draft is down, 503 once the target is.

Metrics: every replica records into its own registry (GET /metrics through the proxy
reaches one replica and says so) and into `ray.util.metrics` (spec_runtime.ray.metrics),
which Ray's metrics agents export for the cluster's Prometheus: those are the sums.

    serve run spec_runtime.ray.serve_app:app_builder target=/models/llama-8b \\
        draft=/models/llama-1b mode=ssd target_device=cuda draft_device=cuda placement=spread

Keys of `app_builder` are the flags of `spec-runtime serve` without the dashes (dashes as
underscores: the model and speculation flags, api_key, served_model_name, max_body_bytes,
metrics_prefix, generation_config, chat_template, tool_call_parser, the HTTP limits),
plus placement, gpus_per_actor, cpus_per_actor, replica_cpus, num_replicas, max_replicas.
"""

from __future__ import annotations

import argparse
import logging
import threading

import ray
from ray import serve

from protocol.codec import decode_config, encode_config
from spec_runtime.config import RuntimeConfig
from spec_runtime.ray.deploy import deploy_in_current_group, roles_of
from spec_runtime.ray.resources import PLACEMENT_STRATEGIES, ActorResources, replica_bundles, resolve
from spec_runtime.server.app_options import AppOptions

logger = logging.getLogger(__name__)

_METRICS_PERIOD_S = 5.0  # how often a replica refreshes its gauges (running, waiting, draft alive)


class _ModelServer:
    """One replica: a RayDeployment in the replica's placement group, an AsyncClient of it,
    and the FastAPI app (as the Serve app's HTTP ingress, or called by the router)."""

    def __init__(self, config: dict, options: dict | None = None):
        from spec_runtime.cli_config import resolve_config_model_ids
        from spec_runtime.ray.metrics import RayMetrics
        from spec_runtime.server.app import model_name_of
        from spec_runtime.server.app_options import AppOptions
        from spec_runtime.server.async_client import AsyncClient
        from spec_runtime.server.metrics import ServerMetrics

        cfg = decode_config(config)
        self._options = AppOptions.from_dict(options) if options is not None else AppOptions()
        self._deployment = deploy_in_current_group(cfg)
        self._client = AsyncClient(client=self._deployment.client())
        # A Hugging Face id is read from this node's cache (the actors read their own).
        self._model_path = resolve_config_model_ids(cfg).target.path
        name = model_name_of(cfg, self._options.served_model_name)
        k = cfg.spec.k if cfg.spec.mode != "ar" else 0
        replica_id = serve.get_replica_context().replica_id.unique_id
        prefix = self._options.metrics_prefix
        self._metrics = ServerMetrics(name, k, mirror=RayMetrics(name, k, prefix=prefix), replica_id=replica_id,
                                      prefix=prefix)
        self._app = None
        self._stop = threading.Event()
        threading.Thread(target=self._refresh_gauges, name="metrics", daemon=True).start()

    def __serve_build_asgi_app__(self):
        if self._app is None:
            from spec_runtime.server.app import build_app

            self._app = build_app(self._client, metrics=self._metrics, **self._options.app_kwargs(self._model_path))
        return self._app

    async def handle_request(self, request: dict):
        """One HTTP request passed on by spec_runtime.ray.router: yields (status, headers),
        then the body's chunks."""
        from spec_runtime.ray.asgi import call_asgi

        async for item in call_asgi(self.__serve_build_asgi_app__(), request):
            yield item

    def _refresh_gauges(self) -> None:
        """Gauges are read from the engine; nobody scrapes a replica, so read them here."""
        from spec_runtime.results import RequestFailed

        while not self._stop.wait(_METRICS_PERIOD_S):
            try:
                stats = self._client.client.engine_stats()
            except RequestFailed:
                stats = None
            self._metrics.observe_engine(stats, self._deployment.num_draft_restarts)

    def check_health(self) -> None:
        dep = self._deployment
        if dep.dead_child() == "target":
            raise RuntimeError("the target actor is dead; this replica cannot serve")
        if dep.draft_given_up:
            raise RuntimeError("the draft actor is dead and could not be replaced")

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        client = getattr(self, "_client", None)
        if client is not None:
            client.client.close()  # also shuts the deployment down


# A replica that cannot load its models three times in a row fails the deployment (Serve's
# default of 20 tries turns a wrong path into minutes of retries).
_OPTIONS = {"health_check_period_s": 2.0, "health_check_timeout_s": 30.0, "max_constructor_retry_count": 3}
# The HTTP ingress of a one-model app, and the same replica behind spec_runtime.ray.router
# (Serve allows one FastAPI ingress per application).
SpecRuntimeServer = serve.deployment(**_OPTIONS)(serve.ingress()(_ModelServer))
RoutedModelServer = serve.deployment(**_OPTIONS)(_ModelServer)


def resolve_resources(cfg: RuntimeConfig, gpus_per_actor: float | None, cpus_per_actor: float | None,
                      replica_cpus: float = 1.0) -> tuple[ActorResources, list[str]]:
    """"auto" (None) GPUs / CPUs per actor from the connected cluster (ray.init() if this
    process has not), checked against the models' devices. Returns (resources, warnings)."""
    if gpus_per_actor is None or cpus_per_actor is None:
        if not ray.is_initialized():
            ray.init()
        cluster = ray.cluster_resources()
    else:
        cluster = {}
    res, warnings = resolve(gpus_per_actor, cpus_per_actor, cluster, len(roles_of(cfg)), replica_cpus)
    models = [cfg.target] + ([cfg.draft] if cfg.spec.uses_draft_process else [])
    on_cuda = [m.device for m in models if m.device.startswith("cuda")]
    if res.gpus == 0 and on_cuda:
        raise ValueError(f"the actors get 0 GPUs but a model's device is {on_cuda[0]!r}: give "
                         "--ray-gpus-per-actor 1 (a GPU per actor), or --target-device cpu --draft-device cpu")
    if cfg.target.tensor_parallel_size > 1 and cfg.target.device.startswith("cuda") and res.gpus != int(res.gpus):
        raise ValueError(f"a tensor-parallel target needs a whole GPU per rank (NCCL refuses two ranks on one "
                         f"GPU): --ray-gpus-per-actor must be whole, got {res.gpus:g}")
    return res, warnings


def build_application(cfg: RuntimeConfig, options: AppOptions | None = None, *, placement: str = "pack",
                      gpus_per_actor: float | None = None, cpus_per_actor: float | None = None,
                      replica_cpus: float = 1.0, num_replicas: int = 1, max_replicas: int | None = None,
                      name: str = "SpecRuntimeServer", ingress: bool = True):
    """A bound Serve application (for `serve.run`). options: the HTTP app's settings, as
    for `spec-runtime serve` (default AppOptions()); its shutdown_timeout_s is Serve's
    graceful_shutdown_timeout_s. gpus_per_actor / cpus_per_actor None: "auto"
    (resolve_resources). max_replicas: autoscale between num_replicas and it.
    ingress False: the deployment answers spec_runtime.ray.router, not HTTP."""
    options = (options or AppOptions()).portable()
    if placement not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement must be 'pack' or 'spread', got {placement!r}")
    if num_replicas < 1 or (max_replicas is not None and max_replicas < num_replicas):
        raise ValueError(f"need 1 <= num_replicas <= max_replicas, got {num_replicas} and {max_replicas}")
    res, warnings = resolve_resources(cfg, gpus_per_actor, cpus_per_actor, replica_cpus)
    for w in warnings:
        logger.warning("%s", w)
    scaling = ({"autoscaling_config": {"min_replicas": num_replicas, "max_replicas": max_replicas}}
               if max_replicas is not None else {"num_replicas": num_replicas})
    deployment = SpecRuntimeServer if ingress else RoutedModelServer
    return deployment.options(
        name=name, ray_actor_options={"num_cpus": res.replica_cpus},
        placement_group_bundles=replica_bundles(res, len(roles_of(cfg))),
        placement_group_strategy=PLACEMENT_STRATEGIES[placement],
        graceful_shutdown_timeout_s=options.http.shutdown_timeout_s, **scaling,
    ).bind(encode_config(cfg), options.to_dict())


_DEPLOY_KEYS = {"placement": str, "gpus_per_actor": float, "cpus_per_actor": float, "replica_cpus": float,
                "num_replicas": int, "max_replicas": int}


def app_builder(args: dict[str, str]):
    """`serve run spec_runtime.ray.serve_app:app_builder key=value ...` (see the module doc)."""
    from spec_runtime.cli_flags import ConfigErrors, add_config_flags, config_from_args
    from spec_runtime.server.app_options import PROXY_HTTP_FIELDS, add_app_flags, app_options_from_args

    args = dict(args)
    kwargs = {k: conv(args.pop(k)) for k, conv in _DEPLOY_KEYS.items() if k in args}
    for key, why in PROXY_HTTP_FIELDS.items():
        if key in args:
            raise ValueError(f"app_builder: {key} does not apply under Ray Serve: {why}")
    parser = argparse.ArgumentParser(prog="app_builder", exit_on_error=False)
    add_app_flags(parser)
    add_config_flags(parser)
    argv = []
    for key, value in args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    try:
        ns = parser.parse_args(argv)
        cfg = config_from_args(ns)
        # generation_config.json is read by each replica, where the model is.
        options = app_options_from_args(ns, None)
    except (argparse.ArgumentError, SystemExit, ConfigErrors) as e:
        raise ValueError(f"bad app_builder arguments {sorted(args)}: {e}") from None
    return build_application(cfg, options, **kwargs)
