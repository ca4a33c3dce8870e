"""`spec-runtime serve --ray`: start the Serve application, report its start, wait for Ctrl-C.

Before Serve is asked for anything the command checks the placement itself, so an
impossible request fails in seconds, not in the Serve controller's log:
  1. every bundle of a replica must fit on some node, and all replicas' bundles in the
     cluster (spec_runtime.ray.resources.unfit_reason): else PlacementError at once;
  2. the replicas' groups are reserved and released again within placement_timeout_s
     (resources held by other work): else PlacementError naming what is free.
Then the app is deployed and watched until it runs (the ready line goes to stdout), fails
(StartupError with the replica's last error), outlives the start-up timeout, or is
interrupted (exit code 130). On SIGINT/SIGTERM the app is deleted; Serve stops too when no
other application is left on the cluster.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time

import ray
from ray import serve
from ray.util.placement_group import placement_group, remove_placement_group

from spec_runtime.config import RuntimeConfig
from spec_runtime.launcher import StartupError
from spec_runtime.ray.deploy import placement_error, roles_of
from spec_runtime.ray.resources import PLACEMENT_STRATEGIES, replica_bundles
from spec_runtime.ray.serve_app import build_application, resolve_resources
from spec_runtime.server.app_options import AppOptions

logger = logging.getLogger(__name__)

APP_NAME = "spec-runtime"


def reserve_or_raise(bundles: list[dict], strategy: str, num_groups: int, timeout_s: float) -> None:
    """Raise PlacementError unless `num_groups` groups of `bundles` can be placed now."""
    from spec_runtime.ray.resources import unfit_reason

    if unfit_reason(bundles, num_groups, ray.nodes()) is not None:
        raise placement_error(bundles, strategy, timeout_s, num_groups)
    groups = [placement_group(bundles, strategy=strategy) for _ in range(num_groups)]
    try:
        deadline = time.monotonic() + timeout_s
        for pg in groups:
            if not pg.wait(max(0.0, deadline - time.monotonic())):
                raise placement_error(bundles, strategy, timeout_s, num_groups)
    finally:
        for pg in groups:
            remove_placement_group(pg)


def _wait_running(timeout_s: float, stop: threading.Event) -> bool:
    """Until the app runs (True) or `stop` is set (False); StartupError with Serve's own
    message if it fails or stalls."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline and not stop.is_set():
        app = serve.status().applications.get(APP_NAME)
        if app is not None:
            status = str(app.status.value if hasattr(app.status, "value") else app.status)
            if status == "RUNNING":
                return True
            details = [f"{name}: {d.status.value} {dict(d.replica_states)} {d.message}".strip()
                       for name, d in app.deployments.items()]
            last = f"{status} {app.message} {'; '.join(details)}".strip()
            if status == "DEPLOY_FAILED":
                logger.debug("Ray Serve's message: %s", last)
                raise StartupError(f"Ray Serve could not deploy the application: {_summary(last)} (the whole "
                                   "traceback is in the Serve controller's log, in Ray's logs/serve/ directory)")
        stop.wait(0.5)
    if stop.is_set():
        return False
    raise StartupError(f"the application did not start within {timeout_s:g} s; Ray Serve says: {last or 'nothing'}")


def _summary(message: str) -> str:
    """Serve's first line and the last exception line of the replica's traceback."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*: ", line)]
    first = lines[0] if lines else ""
    return f"{first} Last error: {errors[-1]}" if errors and errors[-1] != first else first


def run_ray_server(cfg: RuntimeConfig, options: AppOptions | None = None, *, host: str = "127.0.0.1",
                   port: int = 8000, address: str | None = None, placement: str = "pack",
                   gpus_per_actor: float | None = None, cpus_per_actor: float | None = None,
                   replica_cpus: float = 1.0, num_replicas: int = 1, max_replicas: int | None = None,
                   placement_timeout_s: float = 60.0, out=None) -> int:
    """Serve on Ray until SIGINT/SIGTERM; returns the exit code. options: the HTTP app's
    settings, the same as `spec-runtime serve` makes locally (default AppOptions()).
    Raises PlacementError, StartupError, or ValueError (bad arguments) before serving."""
    from spec_runtime.server.app import model_name_of

    options = options or AppOptions()
    out = out or sys.stdout
    if port <= 0:
        raise ValueError("--port must be given with --ray (Serve's proxy binds a fixed port)")
    if placement_timeout_s <= 0:
        raise ValueError("--ray-placement-timeout-s must be > 0")
    if not ray.is_initialized():
        ray.init(address=address)
    res, warnings = resolve_resources(cfg, gpus_per_actor, cpus_per_actor, replica_cpus)
    for w in warnings:
        print(f"spec-runtime: warning: {w}", file=sys.stderr, flush=True)
    strategy = PLACEMENT_STRATEGIES[placement]
    bundles = replica_bundles(res, len(roles_of(cfg)))
    if APP_NAME in _serve_apps():
        raise ValueError(f"a Ray Serve application named {APP_NAME!r} already runs on this cluster; "
                         f"stop it first (`serve delete {APP_NAME}`)")
    reserve_or_raise(bundles, strategy, num_replicas, placement_timeout_s)
    logger.info("placement checked: %d replica(s) of bundles %s (%s)", num_replicas, bundles, strategy)

    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": host, "port": port})
    try:
        app = build_application(cfg, options, placement=placement, gpus_per_actor=res.gpus, cpus_per_actor=res.cpus,
                                replica_cpus=res.replica_cpus, num_replicas=num_replicas, max_replicas=max_replicas)
        serve._run(app, _blocking=False, name=APP_NAME, route_prefix="/")
        if not _wait_running(cfg.startup_timeout_s + placement_timeout_s, stop):
            logger.warning("interrupted while the application was starting")
            return 130
        shown = f"[{host}]" if ":" in host else host
        replicas = f"{num_replicas}..{max_replicas}" if max_replicas is not None else str(num_replicas)
        out.write(f"spec-runtime: serving {model_name_of(cfg, options.served_model_name)} on http://{shown}:{port} "
                  f"(Ray Serve, {replicas} replica(s), {res.gpus:g} GPU and {res.cpus:g} CPU per actor)\n")
        out.flush()
        stop.wait()
        logger.info("stopping the Serve application")
        return 0
    finally:
        _stop_app()


def _serve_apps() -> dict:
    try:
        return serve.status().applications
    except Exception:  # noqa: BLE001 - Serve is not running on this cluster: no applications
        return {}


def _stop_app() -> None:
    try:
        serve.delete(APP_NAME)
        if not _serve_apps():
            serve.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort on the way out; Ray itself may be gone
        logger.warning("could not stop the Serve application: %s", e)
