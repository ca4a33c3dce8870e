"""Start-up failures: a clear error naming the process, within the timeout, no orphans."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from conftest import save_tiny_model
from e2e_util import make_config
from spec_runtime.launcher import Launcher, StartupError

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_no_new_children(before: set[int]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = {pid for pid in _children() - before if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"orphan processes left: {alive}")


def test_bad_target_path(tmp_path):
    before = _children()
    with pytest.raises(StartupError, match=r"target process \(pid \d+\).*does-not-exist"):
        Launcher(make_config(str(tmp_path / "does-not-exist"), mode="ar"))
    _assert_no_new_children(before)


def test_unsupported_architecture_in_draft(tmp_path):
    target = save_tiny_model(tmp_path / "t", "llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 10}))
    before = _children()
    with pytest.raises(StartupError, match=r"draft process \(pid \d+\).*mamba"):
        Launcher(make_config(target, str(bad), mode="sd"))
    _assert_no_new_children(before)


def test_child_that_dies_during_load(tmp_path, monkeypatch):
    target = save_tiny_model(tmp_path / "t", "llama")
    # The draft process runs tests/fault_child.py, which dies the way a crash during load would.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    before = _children()
    with pytest.raises(StartupError, match=r"draft process \(pid \d+\) exited with code 3 during start-up"):
        Launcher(make_config(target, target, mode="sd"), child_modules={"draft": "fault_child"})
    _assert_no_new_children(before)


def test_startup_timeout(tmp_path):
    target = save_tiny_model(tmp_path / "t", "llama")
    before = _children()
    cfg = make_config(target, mode="ar").replace(startup_timeout_s=0.5)
    with pytest.raises(StartupError, match="did not become ready within"):
        Launcher(cfg)
    _assert_no_new_children(before)


def test_shutdown_leaves_nothing(tmp_path):
    target = save_tiny_model(tmp_path / "t", "llama")
    before = _children()
    launcher = Launcher(make_config(target, target, mode="sd"))
    pids = launcher.pids()
    assert set(pids) == {"target", "draft"}
    ipc_dir = launcher.ipc_dir
    assert oct(os.stat(ipc_dir).st_mode & 0o777) == "0o700"
    launcher.shutdown()
    _assert_no_new_children(before)
    assert not os.path.exists(ipc_dir)


def test_a_process_on_a_cuda_device_keeps_torch_to_one_host_thread():
    """The target and draft processes call this at start-up: on CUDA, one CPU thread for
    torch (spinning idle threads in both processes took the cores their loops need); on the
    CPU, torch's threads stay (they run the model)."""
    import torch

    from spec_runtime.child import one_host_thread

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        one_host_thread("cpu")
        assert torch.get_num_threads() == 2
        one_host_thread("cuda:1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
