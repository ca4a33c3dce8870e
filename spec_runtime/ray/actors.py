"""The Ray actor that runs target_proc's or draft_proc's main loop in its own process.

An actor is the process: it calls the same `build(cfg, init)` the subprocess entry points
use and runs the returned main loop in a thread, so the actor's methods (where, ping,
stop) stay answerable while it decodes. A subprocess of the actor would lose what Ray
gave the actor: its place in the placement group and its CUDA_VISIBLE_DEVICES.

Start-up is two calls so the deployment can choose addresses from where the actors
landed: `where()` (node, ip, GPU ids, a free port on that node), then `start(...)`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading

import ray

from protocol.codec import decode_config, encode_config
from protocol.messages import PROTOCOL_VERSION, Init, Ready
from protocol.transport import private_ipc_dir
from spec_runtime.child import setup_logging

logger = logging.getLogger(__name__)

ROLES = ("target", "draft")


def rank_role(rank: int) -> str:
    """The role of tensor-parallel rank `rank` >= 1 of the target (rank 0 is "target")."""
    return f"target-rank{rank}"


def rank_of(role: str) -> int | None:
    """The tensor-parallel rank of a target rank's role; None for target and draft."""
    prefix = "target-rank"
    return int(role[len(prefix):]) if role.startswith(prefix) and role[len(prefix):].isdigit() else None


def pin_device(cfg, role: str, own_gpus: bool = False):
    """`cuda[:N]` -> `cuda:0` for this role: Ray's CUDA_VISIBLE_DEVICES shows the actor only
    the GPUs of its bundle, so the config's host-wide index (cuda:1 for the draft on a
    two-GPU host) means nothing inside it. Every rank of the target is on cuda:0 of its own
    actor. own_gpus: the actor holds whole GPUs, which Ray gives no other actor, so the other
    role's model runs on none of them: its device is named past this actor's (the target's
    cuda:1, the draft's cuda:T beside a target of T ranks), and RuntimeConfig.draft_shares_target_gpu
    reads them apart (a host-wide cuda and cuda would read as one GPU: no SSD rounds)."""
    key = "draft" if role == "draft" else "target"
    model = getattr(cfg, key)
    if not model.device.startswith("cuda"):
        return cfg
    pinned = {key: dataclasses.replace(model, device="cuda:0")}
    other_key = "target" if key == "draft" else "draft"
    other = getattr(cfg, other_key)
    if own_gpus and other.device.startswith("cuda"):
        index = 1 if key == "draft" else cfg.target.tensor_parallel_size
        pinned[other_key] = dataclasses.replace(other, device=f"cuda:{index}")
    return cfg.replace(**pinned)


def holds_whole_gpus() -> bool:
    """Whether Ray gave this actor whole GPUs (it gives those to no other actor)."""
    gpus = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
    return gpus >= 1 and float(gpus).is_integer()


class RoleActor:
    """One child role (target or draft) inside a Ray actor process."""

    def __init__(self, role: str):
        if role not in ROLES and rank_of(role) is None:
            raise ValueError(f"role must be one of {ROLES} or target-rankN, got {role!r}")
        self.role = role
        self.ready: Ready | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def where(self) -> dict:
        """Where Ray placed this actor, and a tcp port free on that node right now."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ip,
            "port": port,
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }

    def free_port(self) -> int:
        """A tcp port free on this node right now (the tensor-parallel group's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def make_ipc_dir(self) -> str:
        """A private 0700 directory on this node for the ipc sockets of the deployment."""
        return private_ipc_dir()

    def start(self, config: dict, spec_addr: str, client_addr: str, keys: dict,
              tp_rendezvous: tuple[str, int] | None = None) -> Ready:
        """Load the model, open the links, start the main loop; return the Ready message.

        keys: {"client_secret", "draft_public"} for the target, {"spec_secret"} for the
        draft; empty over ipc (values are Z85 bytes, generated per deployment).
        tp_rendezvous (target of a tensor-parallel deployment): where its other ranks join.
        """
        from spec_runtime.cli_config import resolve_config_model_ids

        # A Hugging Face id loads from this node's cache.
        cfg = pin_device(resolve_config_model_ids(decode_config(config)), self.role, holds_whole_gpus())
        setup_logging(self.role, cfg.log_level)
        init = Init(protocol_version=PROTOCOL_VERSION, config=encode_config(cfg), spec_addr=spec_addr,
                    client_addr=client_addr if self.role == "target" else "")
        if self.role == "target":
            from target_proc.__main__ import build

            ready, main_loop = build(cfg, init, client_secret_key=keys.get("client_secret"),
                                     draft_public_key=keys.get("draft_public"), tp_rendezvous=tp_rendezvous)
        else:
            from draft_proc.__main__ import build

            ready, main_loop = build(cfg, init, spec_secret_key=keys.get("spec_secret"))
        self.ready = ready
        self._thread = threading.Thread(target=self._run, args=(main_loop,), name=f"{self.role}-main", daemon=True)
        self._thread.start()
        logger.info("%s actor ready on %s (CUDA_VISIBLE_DEVICES=%r)", self.role, ray.util.get_node_ip_address(),
                    os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        return ready

    def start_rank(self, config: dict, tp_rendezvous: tuple[str, int]) -> dict:
        """Tensor-parallel rank >= 1: join rank 0 at tp_rendezvous, build the same runner
        on this actor's device (rank 0 sends the config), then follow rank 0's forwards in
        a thread. Returns once the runner is built: {"rank", "pid"}."""
        from target_proc.follower import join

        cfg = pin_device(decode_config(config), self.role, holds_whole_gpus())
        setup_logging(self.role, cfg.log_level)
        host, port = tp_rendezvous
        rank = rank_of(self.role)
        group, runner = join(rank, cfg.target.tensor_parallel_size, cfg.target.device, port, host=host,
                             timeout_s=cfg.startup_timeout_s)

        def follow() -> None:
            runner.follow()
            group.stop()

        self._thread = threading.Thread(target=self._run, args=(follow,), name=f"{self.role}-follow", daemon=True)
        self._thread.start()
        logger.info("%s actor following rank 0 at %s:%d", self.role, host, port)
        return {"rank": rank, "pid": os.getpid()}

    def _run(self, main_loop) -> None:
        try:
            main_loop()
        except Exception as e:  # noqa: BLE001 - reported by ping(), which the deployment's monitor calls
            logger.exception("%s main loop crashed", self.role)
            self._error = f"{type(e).__name__}: {e}"

    def ping(self) -> dict:
        """{"alive": the main loop is running, "error": why it stopped, "pid": ...}."""
        alive = self._thread is not None and self._thread.is_alive()
        return {"alive": alive, "error": self._error, "pid": os.getpid()}

    def cleanup(self, ipc_dir: str) -> None:
        """Remove a deployment's ipc directory on this node (possibly made by an actor that
        died since); only a `spec-rt-` directory of the temp dir is ever removed."""
        parent, name = os.path.split(os.path.normpath(ipc_dir))
        if parent != os.path.normpath(tempfile.gettempdir()) or not name.startswith("spec-rt-"):
            raise ValueError(f"{ipc_dir!r} is not an ipc directory of this runtime")
        shutil.rmtree(ipc_dir, ignore_errors=True)
