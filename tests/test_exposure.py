"""What the runtime exposes, and how it refuses to start.

Exposure: every socket of target_proc and draft_proc is an ipc socket inside the
launcher's private 0700 directory (no inet listener at all), and `spec-runtime serve`
listens on 127.0.0.1 only by default. Covered elsewhere: the ipc directory's mode and
removal (test_startup.test_shutdown_leaves_nothing), refusing a non-loopback tcp bind
without allow_remote and CURVE rejecting a client without the server key
(test_protocol), HTTP --api-key enforcement (test_server.test_api_key_enforced).

Start-up failures not covered in test_startup: out of memory at load (a KV cache that
cannot be allocated) and a port in use, each with a clear error, a non-zero exit or a
StartupError, and no orphan process.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import save_tiny_model
from e2e_util import make_config
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig
from spec_runtime.launcher import Launcher, StartupError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("exposure") / "t", "llama")


def _inet_listeners(pid: int) -> list:
    return [c for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _runtime_pids(parents: set[int] | None = None) -> set[int]:
    """Live target_proc/draft_proc processes: descendants of this test process, plus
    children of `parents` and orphans (reparented to pid 1), so the runtimes other
    people run on this machine are not counted."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    out = set()
    for p in psutil.process_iter(["cmdline", "status", "ppid"]):
        cmd = p.info["cmdline"] or []
        # Children run as `python -m spec_runtime.child_boot {target,draft} ...`.
        is_child = "spec_runtime.child_boot" in cmd and any(a in ("target", "draft") for a in cmd)
        if not is_child or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if p.pid in mine or p.info["ppid"] == 1 or p.info["ppid"] in (parents or set()):
            out.add(p.pid)
    return out


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_children_listen_only_on_private_ipc(target):
    with Client(make_config(target, target, mode="ssd", k=2)) as client:
        client.generate([5, 6, 7], max_tokens=4)  # every link has carried traffic
        ipc_dir = client.launcher.ipc_dir
        assert oct(os.stat(ipc_dir).st_mode & 0o777) == "0o700"
        for role, pid in client.launcher.pids().items():
            proc = psutil.Process(pid)
            assert proc.net_connections(kind="inet") == [], f"{role} has inet sockets"
            unix = proc.net_connections(kind="unix")
            bound = [c.laddr for c in unix if c.laddr]
            assert bound, f"{role} binds nothing?"  # the target binds client, the draft spec
            for path in bound:
                assert os.path.dirname(path) == ipc_dir, f"{role} bound {path} outside {ipc_dir}"
        assert client.launcher.client_addr == f"ipc://{ipc_dir}/client"


def _serve(target: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "spec_runtime", "serve", target, "--mode", "ar", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_http_server_binds_loopback_by_default(target):
    before = _runtime_pids()
    srv = _serve(target, "--port", "0", "--max-batch-size", "2", "--max-model-len", "64")
    try:
        line = srv.stdout.readline()
        assert line.startswith("spec-runtime: serving"), (line, srv.stderr.read() if srv.poll() is not None else "")
        listeners = _inet_listeners(srv.pid)
        assert listeners and all(ipaddress.ip_address(c.laddr.ip).is_loopback for c in listeners), listeners
        assert line.strip().endswith(f"http://127.0.0.1:{listeners[0].laddr.port}")
        children = _runtime_pids() - before
        assert len(children) == 1  # the target (AR mode)
        for pid in children:
            assert _inet_listeners(pid) == [] and psutil.Process(pid).net_connections(kind="inet") == []
    finally:
        srv.terminate()
        assert srv.wait(30) == 0
    assert _wait_gone(children, 10) == set()


def test_serve_on_a_busy_port_fails_fast(target):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    before = _runtime_pids()
    try:
        srv = _serve(target, "--port", str(port))
        out, err = srv.communicate(timeout=120)
    finally:
        busy.close()
    assert srv.returncode == 1, (out, err)
    assert f"cannot serve on 127.0.0.1:{port}" in err and "in use" in err, err
    assert "serving" not in out
    # Bound before the model load: no child was ever started, so none is left.
    assert _runtime_pids({srv.pid}) - before == set()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_out_of_memory_at_load(target, role):
    """A KV cache that cannot be allocated (about 2.6e14 bytes: malloc refuses at once,
    nothing is touched) fails start-up naming the process and the cause; the other child
    is stopped too."""
    huge = 10**9
    sched = SchedulerConfig(max_batch_size=huge if role == "target" else 2, max_model_len=512,
                            max_draft_seqs=huge if role == "draft" else 2)  # else it inherits max_batch_size
    cfg = make_config(target, target, mode="sd").replace(sched=sched, startup_timeout_s=120.0)
    before = _runtime_pids()
    with pytest.raises(StartupError, match=rf"{role} process \(pid \d+\).*(can't allocate memory|out of memory)"):
        Launcher(cfg)
    assert _wait_gone(_runtime_pids() - before, 10) == set()
