"""Place the target and the draft on the GPUs of a Ray cluster.

    import ray
    from spec_runtime.ray import deploy
    ray.init(address="auto")
    dep = deploy(config, placement="spread")
    with dep.client() as client:
        print(client.generate("Hello", max_tokens=32).text)

A placement group holds one bundle per process: the target's first, then its
tensor-parallel ranks 1..N-1 under --tensor-parallel-size N, the draft's last
({"GPU": gpus_per_actor, "CPU": cpus_per_actor} each). The ranks meet rank 0 over
torch.distributed (loopback when they share its node), as the launcher's do. `deploy()` makes that group
itself: "pack" asks Ray to put the bundles on one node if it can, "spread" on different
nodes if it can (both soft). Under Ray Serve the replica's own group, which Serve reserves
before it starts the replica, holds the replica in bundle 0 and the roles after it
(`deploy_in_current_group`, spec_runtime.ray.serve_app).

Each role is a RoleActor in its bundle, running the main loop itself; Ray sets its
CUDA_VISIBLE_DEVICES. Once placed, the deployment reads where each actor landed and
chooses each link's transport: `ipc://` (a 0700 directory on that node) when both ends
share a node, else `tcp://node-ip:port` with CURVE keys generated for this deployment.
The spec link joins target and draft; the client link joins this process (the driver,
or a Ray Serve replica) and the target.

A dead draft costs speculation, never a request: the target's DraftLink notices the
disconnect and decodes without speculation, the monitor places a new draft actor in the
same bundle, and that actor binds the *same* address with the same keys (a bundle stays
on its node, so the ip and the port are still its own). zmq reconnects the target by
itself and the DraftLink re-adds every sequence. A dead target is final, as locally.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from protocol.codec import encode_config
from protocol.transport import curve_keypair, ipc_address
from spec_runtime.config import RuntimeConfig
from spec_runtime.launcher import StartupError
from spec_runtime.ray.actors import RoleActor, rank_of, rank_role
from spec_runtime.ray.resources import PLACEMENT_STRATEGIES, bundle, describe_nodes, unfit_reason

logger = logging.getLogger(__name__)

Placement = Literal["pack", "spread"]
_MAX_DRAFT_RESTARTS_IN_A_ROW = 3


class PlacementError(RuntimeError):
    """The cluster could not place the deployment's bundles in time; the message says what
    was asked for and what the cluster has."""


def placement_error(bundles: list[dict], strategy: str, timeout_s: float, num_groups: int = 1) -> PlacementError:
    """Why `num_groups` groups of `bundles` were not placed: the bundle that can never fit
    (spec_runtime.ray.resources.unfit_reason), or else what the cluster has free now."""
    nodes = ray.nodes()
    keys = sorted({k for b in bundles for k in b})
    what = f"{num_groups} placement group(s) of bundles {bundles} (strategy {strategy})"
    reason = unfit_reason(bundles, num_groups, nodes)
    if reason is None:
        free = ray.available_resources()
        busy = next((i for i, b in enumerate(bundles) if any(free.get(k, 0.0) < v for k, v in b.items())), None)
        which = (f"bundle {busy} {bundles[busy]} does not fit" if busy is not None
                 else "the bundles do not fit together")
        shown = {k: round(free.get(k, 0.0), 4) for k in keys}
        reason = (f"{which} in what is free, {shown}, of nodes {describe_nodes(nodes, keys)} "
                  "(other work holds the rest)")
        when = f"within {timeout_s:g} s"
    else:
        when = "on this cluster"
    return PlacementError(
        f"Ray could not place {what} {when}: {reason}. Add GPUs or nodes (`ray start --num-gpus=N`), free the "
        "ones in use, or ask for fewer (--ray-gpus-per-actor / --ray-cpus-per-actor, --num-replicas)."
    )


def _cause(e: BaseException) -> str:
    if isinstance(e, RayTaskError) and e.cause is not None:
        return f"{type(e.cause).__name__}: {e.cause}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def deploy(config: RuntimeConfig, placement: Placement = "pack", *, gpus_per_actor: float = 1.0,
           cpus_per_actor: float = 1.0, placement_timeout_s: float = 60.0,
           transport: Literal["auto", "tcp"] = "auto") -> "RayDeployment":
    """Place the target (and the draft, unless mode is "ar") and start them; return once both
    are Ready. Connects to (or starts) Ray with `ray.init()` if this process has not.

    gpus_per_actor: GPUs of each bundle (0 for a CPU-only try-out; models then need
    device "cpu"). transport "tcp" forces tcp+CURVE even where ipc would do.
    Raises PlacementError after placement_timeout_s, StartupError if a role fails to load.
    """
    if placement not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement must be 'pack' or 'spread', got {placement!r}")
    if transport not in ("auto", "tcp"):
        raise ValueError(f"transport must be 'auto' or 'tcp', got {transport!r}")
    if gpus_per_actor < 0 or cpus_per_actor < 0 or placement_timeout_s <= 0:
        raise ValueError("gpus_per_actor and cpus_per_actor must be >= 0, placement_timeout_s > 0")
    if not ray.is_initialized():
        ray.init()
    roles = roles_of(config)
    bundles = [bundle(gpus_per_actor, cpus_per_actor) for _ in roles]
    strategy = PLACEMENT_STRATEGIES[placement]
    if unfit_reason(bundles, 1, ray.nodes()) is not None:  # never placeable: say so at once
        raise placement_error(bundles, strategy, placement_timeout_s)
    pg = placement_group(bundles, strategy=strategy)
    if not pg.wait(placement_timeout_s):
        remove_placement_group(pg)
        raise placement_error(bundles, strategy, placement_timeout_s)
    # On a failed start the deployment tears itself down (actors, group, ipc directories).
    return RayDeployment(config, pg, roles, bundles, force_tcp=transport == "tcp")


def roles_of(config: RuntimeConfig) -> list[str]:
    """One actor (and bundle) each: the target (its rank 0), its ranks 1..N-1 under
    --tensor-parallel-size N, then the draft unless mode is "ar"."""
    ranks = [rank_role(r) for r in range(1, config.target.tensor_parallel_size)]
    return ["target", *ranks] + (["draft"] if config.spec.uses_draft_process else [])


def deploy_in_current_group(config: RuntimeConfig, first_bundle: int = 1) -> "RayDeployment":
    """Start the roles in the placement group this process runs in (a Serve replica's,
    reserved by Serve before the replica started): the target in bundle `first_bundle`,
    the draft in the next. The group is not this deployment's to remove."""
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("deploy_in_current_group needs a placement group: give the Serve deployment "
                           "placement_group_bundles (spec_runtime.ray.serve_app does)")
    roles = roles_of(config)
    bundles = pg.bundle_specs
    if len(bundles) < first_bundle + len(roles):
        raise RuntimeError(f"the placement group has {len(bundles)} bundles; {roles} need bundles "
                           f"{first_bundle}..{first_bundle + len(roles) - 1}")
    return RayDeployment(config, pg, roles, bundles[first_bundle:first_bundle + len(roles)], force_tcp=False,
                         first_bundle=first_bundle, owns_group=False)


def _teardown(actors: dict, pg, ipc_dirs: list[tuple[str, str]], owns_group: bool) -> None:
    """Kill the actors, drop the placement group, remove the ipc directories (best effort:
    this also runs at interpreter exit, when Ray may be gone already)."""
    if not ray.is_initialized():
        return
    try:
        for role, path in ipc_dirs:
            if role in actors:
                ray.get(actors[role].cleanup.remote(path), timeout=5)
    except RayError as e:
        logger.info("could not remove the ipc directories: %s", _cause(e))
    for actor in actors.values():
        ray.kill(actor)
    if owns_group:
        remove_placement_group(pg)


class RayDeployment:
    """A started deployment; it looks like a Launcher to Client and to the HTTP app:
    `client_addr`, `client_curve_server_key`, `ready`, `dead_child()`, `pids()`,
    `num_draft_restarts`, `shutdown()`. Also: `actors`, `where` (node, ip, GPU ids per role),
    `transports` ({"spec": "ipc"|"tcp", "client": ...})."""

    def __init__(self, cfg: RuntimeConfig, pg, roles: list[str], bundles: list[dict], force_tcp: bool,
                 first_bundle: int = 0, owns_group: bool = True):
        self.cfg = cfg
        self.placement_group = pg
        self._bundles = {role: (first_bundle + i, bundles[i]) for i, role in enumerate(roles)}
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self._num_actors = 0
        self._ipc_dirs: list[tuple[str, str]] = []  # (role whose node has it, path)
        self._finalizer = weakref.finalize(self, _teardown, self.actors, pg, self._ipc_dirs, owns_group)
        self.num_draft_restarts = 0
        self.draft_given_up = False  # True after _MAX_DRAFT_RESTARTS_IN_A_ROW failed restarts
        self._dead: str | None = None
        self._stopping = False
        try:
            for role in roles:
                self.actors[role] = self._new_actor(role)
            self.where = dict(zip(roles, ray.get([a.where.remote() for a in self.actors.values()])))
            self._choose_links(roles, force_tcp)
            self._choose_rendezvous(roles)
            self.ready = self._start_all(roles)
        except BaseException:
            self._finalizer()
            raise
        self._monitor = threading.Thread(target=self._watch, name="ray-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ start-up

    def _new_actor(self, role: str):
        """A RoleActor in the role's bundle, named `spec-runtime-<role>-<group id>-<n>` so
        `ray list actors` shows which is which."""
        index, spec = self._bundles[role]
        self._num_actors += 1
        name = f"spec-runtime-{role}-{self.placement_group.id.hex()[:8]}-{self._num_actors}"
        return ray.remote(RoleActor).options(
            name=name, num_cpus=spec.get("CPU", 0.0), num_gpus=spec.get("GPU", 0.0), max_restarts=0,
            runtime_env={"env_vars": {"TQDM_DISABLE": "1"}},  # Ray logs get the loader's log lines, no bars
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=index),
        ).remote(role)

    def _choose_links(self, roles: list[str], force_tcp: bool) -> None:
        driver_node = ray.get_runtime_context().get_node_id()
        t = self.where["target"]
        self.keys: dict[str, dict] = {role: {} for role in roles}
        self.keys.setdefault("draft", {})
        self.client_curve_server_key: bytes | None = None
        self.transports: dict[str, str] = {}
        if "draft" in roles:
            d = self.where["draft"]
            if d["node_id"] == t["node_id"] and not force_tcp:
                self.spec_addr = ipc_address(self._ipc_dir("draft"), "spec")
                self.transports["spec"] = "ipc"
            else:
                public, secret = curve_keypair()
                self.keys["draft"]["spec_secret"] = secret
                self.keys["target"]["draft_public"] = public
                self.spec_addr = f"tcp://{d['ip']}:{d['port']}"
                self.transports["spec"] = "tcp"
        else:
            self.spec_addr = ""
        if t["node_id"] == driver_node and not force_tcp:
            self.client_addr = ipc_address(self._ipc_dir("target"), "client")
            self.transports["client"] = "ipc"
        else:
            public, secret = curve_keypair()
            self.keys["target"]["client_secret"] = secret
            self.client_curve_server_key = public
            self.client_addr = f"tcp://{t['ip']}:{t['port']}"
            self.transports["client"] = "tcp"
        logger.info("ray deployment links: %s (spec %s, client %s)", self.transports, self.spec_addr, self.client_addr)

    def _ipc_dir(self, role: str) -> str:
        node = self.where[role]["node_id"]
        for r, path in self._ipc_dirs:
            if self.where[r]["node_id"] == node:
                return path
        path = ray.get(self.actors[role].make_ipc_dir.remote())
        self._ipc_dirs.append((role, path))
        return path

    def _choose_rendezvous(self, roles: list[str]) -> None:
        """Where the target's tensor-parallel ranks meet rank 0: loopback when every rank
        landed on the target's node, else the target node's address."""
        ranks = [r for r in roles if rank_of(r) is not None]
        self.tp_rendezvous = None
        if not ranks:
            return
        t = self.where["target"]
        port = ray.get(self.actors["target"].free_port.remote())
        same_node = all(self.where[r]["node_id"] == t["node_id"] for r in ranks)
        if not same_node:
            logger.warning("the target's tensor-parallel ranks are on %d nodes: their collectives cross the "
                           "network (place them on one node with placement 'pack' where it fits)",
                           len({self.where[r]["node_id"] for r in ["target", *ranks]}))
        self.tp_rendezvous = ("127.0.0.1" if same_node else t["ip"], port)

    def _start_one(self, role: str):
        config = encode_config(self.cfg)
        if rank_of(role) is not None:
            return self.actors[role].start_rank.remote(config, self.tp_rendezvous)
        if role == "target":
            return self.actors[role].start.remote(config, self.spec_addr, self.client_addr, self.keys[role],
                                                  self.tp_rendezvous)
        return self.actors[role].start.remote(config, self.spec_addr, self.client_addr, self.keys[role])

    def _start_all(self, roles: list[str]) -> dict:
        """Start every role at once (loads overlap; the target waits for the draft's link)
        and surface the first failure at once, named, instead of waiting out the timeout."""
        pending = {self._start_one(role): role for role in roles}
        ready = {}
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                names = ", ".join(f"{r} actor (pid {self.where[r]['pid']})" for r in pending.values())
                raise StartupError(f"{names} did not become ready within {self.cfg.startup_timeout_s:g} s")
            role = pending.pop(done[0])
            try:
                got = ray.get(done[0])
            except RayError as e:
                w = self.where[role]
                raise StartupError(f"{role} actor (node {w['ip']}, pid {w['pid']}): {_cause(e)}") from e
            if rank_of(role) is not None:  # a rank of the target: it has joined rank 0 (no Ready of its own)
                logger.info("%s actor ready", role)
                continue
            ready[role] = got
            logger.info("%s actor ready: %s", role, got.model_name)
        return ready

    # ------------------------------------------------------------------ serving

    def _alive(self, role: str) -> bool:
        """False once the actor is gone or its main loop has stopped. A slow answer counts
        as alive: a stalled draft is the DraftLink's business (it stops waiting on it)."""
        try:
            state = ray.get(self.actors[role].ping.remote(), timeout=5.0)
        except GetTimeoutError:
            return True
        except RayActorError as e:
            logger.error("%s actor died: %s", role, _cause(e))
            return False
        if not state["alive"]:
            logger.error("%s actor's main loop stopped: %s", role, state["error"])
        return state["alive"]

    def _watch(self) -> None:
        ranks = [r for r in self.actors if rank_of(r) is not None]
        while not self._stopping:
            if self._dead != "target" and not self._alive("target"):
                self._dead = "target"
            if self._dead != "target" and not self._stopping and not all(self._alive(r) for r in ranks):
                # A rank's death is the target's: rank 0 would wait on it in its next collective.
                self._dead = "target"
                ray.kill(self.actors["target"])
            if "draft" in self.actors and self._dead is None and not self._stopping and not self._alive("draft"):
                self._dead = "draft"
                self._restart_draft()
            time.sleep(0.2)

    def _restart_draft(self) -> None:
        """Place a new draft actor in the draft's bundle; it binds the old address."""
        for attempt in range(1, _MAX_DRAFT_RESTARTS_IN_A_ROW + 1):
            if self._stopping:
                return
            ray.kill(self.actors["draft"])  # a draft whose loop stopped still holds the bundle
            self.actors["draft"] = self._new_actor("draft")
            try:
                where = ray.get(self.actors["draft"].where.remote(), timeout=self.cfg.startup_timeout_s)
                ready = ray.get(self._start_one("draft"), timeout=self.cfg.startup_timeout_s)
            except (RayError, GetTimeoutError) as e:
                logger.error("draft restart %d failed: %s", attempt, _cause(e))
                time.sleep(min(5.0, attempt))
                continue
            self.where["draft"], self.ready["draft"] = where, ready
            self.num_draft_restarts += 1
            self._dead = None
            logger.warning("new draft actor (pid %d) is ready (restart %d)", where["pid"], self.num_draft_restarts)
            return
        self.draft_given_up = True
        logger.error("giving up on the draft after %d failed restarts; serving without speculation",
                     _MAX_DRAFT_RESTARTS_IN_A_ROW)

    def client(self, **kw):
        """A Client of this deployment; closing it shuts the deployment down."""
        from spec_runtime.cli_config import resolve_config_model_ids
        from spec_runtime.client import Client

        # The tokenizer of a Hugging Face id comes from this node's cache.
        return Client(resolve_config_model_ids(self.cfg), launcher=self, **kw)

    def dead_child(self) -> str | None:
        """'target' once the target is gone (final); 'draft' while a new draft is placed."""
        return self._dead

    def pids(self) -> dict[str, int]:
        return {role: w["pid"] for role, w in self.where.items()}

    def gpu_ids(self) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES of each role, as Ray set it."""
        return {role: w["cuda_visible_devices"] for role, w in self.where.items()}

    def shutdown(self) -> None:
        self._stopping = True
        if hasattr(self, "_monitor") and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=10.0)
        self._finalizer()
