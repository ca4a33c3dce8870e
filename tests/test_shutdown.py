"""`spec-runtime serve` as a process: SIGTERM drains and ends open streams properly,
kill -9 leaves an ipc directory the next start removes, /health tells degraded from
dead, and a child whose parent dies during its imports does not outlive it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import save_tiny_pair
from e2e_util import make_config, wait_until
from http_util import sse_events
from spec_runtime.launcher import Launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # A long context, so a stream can outlast the drain deadline.
    return save_tiny_pair(tmp_path_factory.mktemp("shutdown"), max_position_embeddings=8192)


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "spec_runtime", "serve", "--port", "0", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving" in line, f"serve did not start (exit {proc.poll()}): {line!r}"
    return proc, line.strip().rsplit(" ", 1)[-1]


def _ipc_dir(proc: subprocess.Popen) -> str:
    """The private ipc directory, read from a child's --control argument."""
    for child in psutil.Process(proc.pid).children():
        cmd = child.cmdline()
        if "--control" in cmd:
            return os.path.dirname(cmd[cmd.index("--control") + 1].removeprefix("ipc://"))
    raise AssertionError("no child with --control")


def test_sigterm_drains_then_ends_open_streams(models):
    target, _ = models
    proc, url = _serve("--target", target, "--mode", "ar", "--max-model-len", "8192", "--shutdown-timeout", "1",
                       "--served-model-name", "m")
    try:
        ipc_dir = _ipc_dir(proc)
        children = psutil.Process(proc.pid).children()
        short = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3},
                           timeout=60)
        assert short.status_code == 200
        bodies: list[bytes] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                out = b""
                for part in r.iter_bytes():
                    out += part
                    first_chunk.set()
                bodies.append(out)

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert len(bodies) == 2
        for body in bodies:
            events = sse_events(body)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "server_shutting_down", events[-2]
            assert any("choices" in e for e in events[:-2])  # it streamed before it was ended
        assert not os.path.exists(ipc_dir)
        assert wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), 10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kill9_leaves_a_stale_dir_that_the_next_start_removes(models):
    target, _ = models
    proc, url = _serve("--target", target, "--mode", "ar")
    ipc_dir = _ipc_dir(proc)
    children = psutil.Process(proc.pid).children()
    proc.kill()
    proc.wait()
    # The children follow their parent (parent-death signal); the directory stays behind.
    assert wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), 10)
    assert os.path.isdir(ipc_dir)
    launcher = Launcher(make_config(target, mode="ar"))
    try:
        assert not os.path.exists(ipc_dir)
        assert os.path.isdir(launcher.ipc_dir)
    finally:
        launcher.shutdown()
    assert not os.path.exists(launcher.ipc_dir)


def test_health_degraded_while_the_draft_is_away(models):
    target, draft = models
    proc, url = _serve("--target", target, "--draft", draft, "--mode", "sd", "--k", "3", "--served-model-name", "m")
    try:
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        draft_pid = next(c.pid for c in psutil.Process(proc.pid).children() if "draft" in " ".join(c.cmdline()))
        os.kill(draft_pid, signal.SIGKILL)
        seen = []

        def degraded() -> bool:
            r = httpx.get(url + "/health", timeout=10)
            seen.append((r.status_code, r.json()["status"]))
            return seen[-1] == (200, "degraded")

        assert wait_until(degraded, 10, poll_s=0.05), seen
        # Requests are served meanwhile, and /v1/engine_stats answers without the draft.
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(url + "/v1/engine_stats", timeout=10).status_code == 200
        assert wait_until(lambda: httpx.get(url + "/health", timeout=10).json()["status"] == "ok", 120, poll_s=0.2)
        # A dead target is dead: 503 (the server stays up with --on-target-death stay only; here it exits 1).
        target_pid = next(c.pid for c in psutil.Process(proc.pid).children() if "target" in " ".join(c.cmdline()))
        os.kill(target_pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_dead_is_503(models):
    target, _ = models
    proc, url = _serve("--target", target, "--mode", "ar", "--on-target-death", "stay")
    try:
        target_pid = next(c.pid for c in psutil.Process(proc.pid).children() if "target" in " ".join(c.cmdline()))
        os.kill(target_pid, signal.SIGKILL)
        assert wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, 10)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "dead"
        r = httpx.post(url + "/v1/completions", json={"model": target, "prompt": [5, 6], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


PARENT = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-m", "spec_runtime.child_boot", "target", "--parent-pid", str(os.getpid()),
                          "--control", "ipc:///nonexistent-spec-rt/ctl"])
print(child.pid, flush=True)
time.sleep(float(sys.argv[1]))  # the child is importing torch meanwhile
os._exit(0)
"""


@pytest.mark.parametrize("parent_lives_s", [0.0, 0.3, 1.0])
def test_child_exits_when_its_parent_dies_during_imports(parent_lives_s):
    parent = subprocess.run([sys.executable, "-c", PARENT, str(parent_lives_s)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    child_pid = int(parent.stdout.split()[0])
    t0 = time.monotonic()

    def gone() -> bool:
        try:
            return psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert wait_until(gone, 5), f"child {child_pid} still alive {time.monotonic() - t0:.1f} s after its parent died"


def test_child_of_an_other_parent_exits_at_once():
    """A parent that died before the child could check (the child was re-parented)."""
    r = subprocess.run([sys.executable, "-m", "spec_runtime.child_boot", "target", "--parent-pid", "1",
                        "--control", "ipc:///nonexistent-spec-rt/ctl"], cwd=ROOT, timeout=30)
    assert r.returncode == 1


def test_http_config_is_validated():
    from spec_runtime.server.http_limits import HTTPConfig

    for bad in ({"max_headers": 0}, {"header_timeout_s": 0}, {"max_header_bytes": 100}, {"shutdown_timeout_s": -1}):
        with pytest.raises(ValueError):
            HTTPConfig(**bad)
    assert json.loads(json.dumps(HTTPConfig().__dict__))["shutdown_timeout_s"] == 30.0
