"""Start target_proc and draft_proc, run the handshake, watch them, tear them down.

The handshake (Hello -> Init -> Ready) polls each child's control socket *and* its
process, so a child that dies while loading is reported with its exit code instead of
hung on; a child that sends ErrorReply(code="startup") is reported with its own words.
Either way every child is stopped before the error reaches the caller: no orphans.
Once both are ready, a draft whose tokenizer differs from the target's is refused
(spec_runtime.vocab_check). Teardown is registered with weakref.finalize, so it also runs
if the owner forgets, and removes the private ipc directory; a start first removes the
directories of owners that died without doing so (kill -9). Each child is started by
spec_runtime.child_boot, which ties its life to this process before its imports.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field, replace

import zmq

from protocol.codec import ProtocolError, encode_config
from protocol.messages import PROTOCOL_VERSION, ErrorReply, HandshakeMessage, Hello, Init, Ready
from protocol.transport import Channel, ipc_address, private_ipc_dir, remove_stale_ipc_dirs
from spec_runtime.config import RuntimeConfig
from spec_runtime.vocab_check import vocabulary_mismatch

logger = logging.getLogger(__name__)

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def format_startup(phases: dict[str, dict[str, float]]) -> str:
    """'target: load 3.10 s, kv_alloc 0.01 s, ...; draft: ready 4.00 s' for a log line."""
    return "; ".join(
        f"{role}: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in p.items()) for role, p in phases.items()
    )


def _warn_few_draft_slots(target: Ready, draft: Ready) -> None:
    """Say so when the draft holds fewer sequences than the target runs (the rest decode
    without speculation)."""
    if draft.model_name != "ngram" and draft.max_batch_size < target.max_batch_size:
        logger.warning("the draft holds %d sequences, the target runs up to %d: the rest decode without "
                       "speculation; lower --max-num-seqs or raise --max-draft-seqs", draft.max_batch_size,
                       target.max_batch_size)


class StartupError(RuntimeError):
    """A child process failed to start; the message names the process and the cause."""


@dataclass
class _Child:
    role: str
    proc: subprocess.Popen
    ctl: Channel
    init: Init
    ready: Ready | None = None
    hello: bool = False
    spawned_at: float = field(default_factory=time.monotonic)
    ready_s: float = 0.0  # spawn -> Ready, seconds

    @property
    def name(self) -> str:
        return f"{self.role} process (pid {self.proc.pid})"


def child_config(cfg: RuntimeConfig) -> RuntimeConfig:
    """The config the children get: no tree prefetched for a new sequence where no SSD round can
    run (cfg.ssd_rounds_possible, as the round policy reads it): nothing would look it up, and on
    the target's GPU its work slows the target's steps (docs/benchmarks.md)."""
    if cfg.spec.mode == "ssd" and cfg.spec.ssd_prefetch and not cfg.ssd_rounds_possible:
        return cfg.replace(spec=replace(cfg.spec, ssd_prefetch=False))
    return cfg


def _spawn(role: str, module: str, control_addr: str, cfg: RuntimeConfig) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PROJECT_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.Popen(
        [sys.executable, "-m", "spec_runtime.child_boot", role, "--parent-pid", str(os.getpid()),
         "--module", module, "--control", control_addr, "--log-level", cfg.log_level],
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _stop_processes(procs: list[subprocess.Popen], ipc_dir: str | None, grace_s: float = 3.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)


class Launcher:
    """Owns the child processes of one runtime.

    After construction: `client_addr` is where clients connect, `ready` maps role to the
    child's Ready message, and `dead_child()` names a child that has exited.
    """

    def __init__(self, cfg: RuntimeConfig, *, child_modules: dict[str, str] | None = None):
        """child_modules: the module each role's process runs ({"draft": "draft_proc"} and
        {"target": "target_proc"} unless given; tests start fault-injecting children this way)."""
        cfg.check_shared_gpu()  # before anything starts
        self.cfg = cfg = child_config(cfg)
        self.child_modules = {"target": "target_proc", "draft": "draft_proc", **(child_modules or {})}
        remove_stale_ipc_dirs()
        self.ipc_dir = private_ipc_dir()
        self.client_addr = ipc_address(self.ipc_dir, "client")
        self.spec_addr = ipc_address(self.ipc_dir, "spec")
        self.children: dict[str, _Child] = {}
        self._finalizer = weakref.finalize(self, _stop_processes, [], self.ipc_dir)
        roles = ["draft", "target"] if cfg.spec.uses_draft_process else ["target"]
        try:
            for role in roles:
                self._start(role)
            self._handshake()
            if "draft" in self.children:
                why = vocabulary_mismatch(cfg, self.children["target"].ready, self.children["draft"].ready)
                if why is not None:
                    raise StartupError(why)
                _warn_few_draft_slots(self.children["target"].ready, self.children["draft"].ready)
        except BaseException:
            self.shutdown()
            raise
        self.ready = {role: c.ready for role, c in self.children.items()}
        logger.info("start-up: %s", format_startup(self.startup_phases()))
        self._dead: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self.num_draft_restarts = 0
        self._monitor = threading.Thread(target=self._watch, name="child-monitor", daemon=True)
        self._monitor.start()

    def _start(self, role: str) -> None:
        ctl = Channel(zmq.PAIR, HandshakeMessage)
        addr = ipc_address(self.ipc_dir, f"{role}-ctl")
        ctl.bind(addr)
        init = Init(
            protocol_version=PROTOCOL_VERSION,
            config=encode_config(self.cfg),
            spec_addr=self.spec_addr,
            client_addr=self.client_addr if role == "target" else "",
        )
        proc = _spawn(role, self.child_modules[role], addr, self.cfg)
        self.children[role] = _Child(role, proc, ctl, init)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _stop_processes, [c.proc for c in self.children.values()], self.ipc_dir
        )

    def _handshake(self, roles: list[str] | None = None) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        pending = {r: c for r, c in self.children.items() if roles is None or r in roles}
        while pending:
            for role, child in list(pending.items()):
                code = child.proc.poll()
                if code is not None:
                    # It may have said why before exiting.
                    msg = self._recv(child, 0.2)
                    if isinstance(msg, ErrorReply):
                        raise StartupError(msg.message)
                    raise StartupError(f"{child.name} exited with code {code} during start-up")
                msg = self._recv(child, 0.05)
                if msg is None:
                    continue
                if isinstance(msg, Hello) and not child.hello:
                    if msg.protocol_version != PROTOCOL_VERSION:
                        raise StartupError(f"{child.name} speaks protocol {msg.protocol_version}, expected {PROTOCOL_VERSION}")
                    child.hello = True
                    child.ctl.send(child.init)
                elif isinstance(msg, Ready) and child.hello:
                    child.ready = msg
                    child.ready_s = time.monotonic() - child.spawned_at
                    del pending[role]
                    logger.info("%s ready: %s", child.name, msg.model_name)
                elif isinstance(msg, ErrorReply):
                    raise StartupError(msg.message)
                else:
                    raise StartupError(f"{child.name} sent {type(msg).__name__} out of order during start-up")
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending.values())
                raise StartupError(f"{names} did not become ready within {self.cfg.startup_timeout_s:.0f} s")

    @staticmethod
    def _recv(child: _Child, timeout_s: float):
        try:
            return child.ctl.recv(timeout_s=timeout_s)
        except ProtocolError as e:
            raise StartupError(f"{child.name} sent a malformed handshake message: {e}") from e

    def _watch(self) -> None:
        """Notice a dead child within 0.2 s. A dead target is final (every request fails);
        a dead draft is restarted, and the target decodes without speculation meanwhile."""
        while self._finalizer.alive and not self._stopping:
            target = self.children["target"]
            if target.proc.poll() is not None and self._dead != "target":
                self._dead = "target"
                logger.error("%s exited with code %s", target.name, target.proc.returncode)
            draft = self.children.get("draft")
            if draft is not None and draft.proc.poll() is not None and self._dead is None:
                self._dead = "draft"
                logger.error("%s exited with code %s; starting a new draft", draft.name, draft.proc.returncode)
                self._restart_draft()
            time.sleep(0.2)

    def _restart_draft(self) -> None:
        for attempt in range(1, 4):
            with self._lock:
                if self._stopping:
                    return
                self.children["draft"].ctl.close()
                self._start("draft")
            try:
                self._handshake(["draft"])
            except StartupError as e:
                logger.error("draft restart %d failed: %s", attempt, e)
                time.sleep(min(5.0, attempt))
                continue
            why = vocabulary_mismatch(self.cfg, self.ready["target"], self.children["draft"].ready)
            if why is not None:
                logger.error("refusing the new draft (%s); serving without speculation", why)
                _stop_processes([self.children["draft"].proc], None)
                return
            self.num_draft_restarts += 1
            self.ready["draft"] = self.children["draft"].ready
            if self._dead == "draft":
                self._dead = None
            logger.warning("new %s is ready (restart %d)", self.children["draft"].name, self.num_draft_restarts)
            return
        logger.error("giving up on the draft after 3 failed restarts; serving without speculation")

    def dead_child(self) -> str | None:
        """'target' once the target has exited (final); 'draft' while the draft is down
        (a new one is being started); else None."""
        return self._dead

    def startup_phases(self) -> dict[str, dict[str, float]]:
        """Seconds per start-up phase of each child: what its Ready reports (the target's
        load, kv_alloc, graph_capture) and ready_s, from spawn to Ready."""
        out = {}
        for role, c in self.children.items():
            phases = dict(c.ready.startup_phases) if c.ready is not None else {}
            phases["ready_s"] = c.ready_s
            out[role] = {k: round(v, 3) for k, v in phases.items()}
        return out

    def pids(self) -> dict[str, int]:
        return {role: c.proc.pid for role, c in self.children.items()}

    def shutdown(self) -> None:
        self._stopping = True
        with getattr(self, "_lock", threading.Lock()):
            for child in self.children.values():
                child.ctl.close()
            self._finalizer()
