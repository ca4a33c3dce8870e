"""What each process of a Ray deployment asks for, and whether the cluster can ever give it.

Pure functions over plain dicts (Ray's `cluster_resources()` and `nodes()` shapes), so
they are tested without a cluster. One bundle per process: the Serve replica (the HTTP
front-end and the client link), the target, and the draft unless mode is "ar".
"""

from __future__ import annotations

import dataclasses
import math

PLACEMENT_STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


@dataclasses.dataclass(frozen=True)
class ActorResources:
    """Resources of one target or draft actor (its bundle), and of the replica's bundle."""

    gpus: float
    cpus: float
    replica_cpus: float = 1.0

    def __post_init__(self):
        if self.gpus < 0 or self.cpus < 0:
            raise ValueError(f"GPUs and CPUs per actor must be >= 0, got {self.gpus:g} and {self.cpus:g}")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise ValueError(f"GPUs per actor above 1 must be whole, got {self.gpus:g}")
        if self.replica_cpus <= 0:
            raise ValueError(f"the replica's CPUs must be > 0, got {self.replica_cpus:g}")
        if self.gpus == 0 and self.cpus == 0:
            raise ValueError("an actor must ask for some CPU when it asks for no GPU")


def bundle(gpus: float, cpus: float) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if gpus:
        b["GPU"] = float(gpus)
    return b


def actor_bundles(res: ActorResources, num_actors: int) -> list[dict[str, float]]:
    """The actors' bundles: target first, draft last."""
    return [bundle(res.gpus, res.cpus) for _ in range(num_actors)]


def replica_bundles(res: ActorResources, num_actors: int) -> list[dict[str, float]]:
    """One replica's bundles: the replica itself first (Serve schedules it in bundle 0),
    then the target's, then the draft's."""
    return [{"CPU": float(res.replica_cpus)}] + actor_bundles(res, num_actors)


def resolve(gpus: float | None, cpus: float | None, cluster: dict[str, float], num_actors: int,
            replica_cpus: float = 1.0) -> tuple[ActorResources, list[str]]:
    """Fill in "auto" (None) GPUs and CPUs per actor from the cluster's totals.

    GPUs: 1 where the cluster has any, else 0 (the models then run on the CPU).
    CPUs: 1, or an equal share of the cluster's CPUs when one replica's bundles would not
    fit in them otherwise (a laptop or a 2-core VM). Returns the resources and the warnings
    to show the operator.
    """
    warnings = []
    if gpus is None:
        gpus = 1.0 if cluster.get("GPU", 0.0) >= 1 else 0.0
        if gpus == 0:
            warnings.append("the Ray cluster has no GPUs: the target and draft actors get 0 GPUs and run on the CPU "
                            "(give --ray-gpus-per-actor to choose)")
    if cpus is None:
        total = cluster.get("CPU", 0.0)
        cpus = 1.0
        if total and replica_cpus + num_actors > total:
            cpus = math.floor((total - replica_cpus) / num_actors * 100) / 100
            if cpus <= 0:
                cpus = 0.01
            warnings.append(f"the Ray cluster has {total:g} CPUs: each actor gets {cpus:g} CPU "
                            "(give --ray-cpus-per-actor to choose)")
    return ActorResources(gpus=gpus, cpus=cpus, replica_cpus=replica_cpus), warnings


def _fmt(res: dict[str, float], keys) -> str:
    return "{" + ", ".join(f"{k}: {res.get(k, 0.0):g}" for k in keys) + "}"


def describe_nodes(nodes: list[dict], keys) -> str:
    alive = [n for n in nodes if n.get("Alive")]
    return "; ".join(f"{n.get('NodeManagerAddress', '?')} {_fmt(n.get('Resources', {}), keys)}" for n in alive) or "none"


def unfit_reason(bundles: list[dict[str, float]], num_replicas: int, nodes: list[dict]) -> str | None:
    """Why `num_replicas` copies of `bundles` can never be placed on these nodes (their
    total resources, whatever runs on them), or None where they might be.

    Soft PACK/SPREAD lets bundles of one group land on different nodes, so the checks are:
    every bundle fits some single node, and the sum of all bundles fits the cluster.
    """
    keys = sorted({k for b in bundles for k in b})
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    for i, b in enumerate(bundles):
        if not any(all(node.get(k, 0.0) >= v for k, v in b.items()) for node in alive):
            return (f"bundle {i} {_fmt(b, sorted(b))} fits on no node; the nodes have: "
                    f"{describe_nodes(nodes, keys)}")
    asked = {k: num_replicas * sum(b.get(k, 0.0) for b in bundles) for k in keys}
    total = {k: sum(node.get(k, 0.0) for node in alive) for k in keys}
    short = [k for k in keys if asked[k] > total[k] + 1e-9]
    if short:
        return (f"{num_replicas} replica(s) of bundles {bundles} need {_fmt(asked, keys)} in all; the cluster has "
                f"{_fmt(total, keys)} (nodes: {describe_nodes(nodes, keys)})")
    return None
