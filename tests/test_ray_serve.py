"""`spec-runtime serve --ray` on a CPU-only Ray cluster, as an operator runs it.

The test process starts one local Ray instance (4 logical CPUs, no GPUs, Ray's metrics
agent on a known port); each test runs the command as a subprocess that joins it with
--ray-address. One server with two replicas answers the chat and metrics tests; an
impossible placement is refused by the command itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import ray  # the `test` extra installs ray[serve]

from conftest import save_tiny_model
from e2e_util import wait_until

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("ray_serve") / "t", "llama")
    metrics_port = _free_port()
    # Ray's workers inherit this environment: this checkout's code, metrics every second.
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "RAY_metrics_report_interval_ms": "1000"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port)
    try:
        yield {"model": model, "address": ray.get_runtime_context().gcs_address, "metrics_port": metrics_port,
               "tmp": tmp_path_factory.mktemp("ray_serve_logs")}
    finally:
        ray.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _command(cluster, port: int, *flags: str) -> list[str]:
    m = cluster["model"]
    return [sys.executable, "-m", "spec_runtime", "serve", "--ray", "--ray-address", cluster["address"],
            "--port", str(port), "--target", m, "--draft", m, "--mode", "sd", "--k", "3",
            "--max-model-len", "256", *flags]


def _run(cluster, argv: list[str], name: str) -> tuple[subprocess.Popen, "object"]:
    err = open(cluster["tmp"] / f"{name}.err", "a+")  # append: the test reads it while the child writes
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    return proc, err


def test_placement_that_cannot_fit_fails_with_resources_and_bundle(cluster):
    proc, err = _run(cluster, _command(cluster, _free_port(), "--ray-gpus-per-actor", "1"), "unfit")
    out, _ = proc.communicate(timeout=120)
    err.seek(0)
    msg = err.read()
    assert proc.returncode == 1, msg
    assert "spec-runtime: placement failed: Ray could not place 1 placement group(s)" in msg
    assert "bundle 1 {CPU: 1, GPU: 1} fits on no node" in msg  # the bundle that did not fit
    assert re.search(r"\{CPU: 4, GPU: 0\}", msg)  # what the cluster's node has
    assert "--ray-gpus-per-actor" in msg and "serving" not in out


@pytest.fixture(scope="module")
def server(cluster):
    """Two replicas, each with its target and draft actor, no GPUs, half a CPU per actor."""
    port = _free_port()
    proc, err = _run(cluster, _command(cluster, port, "--ray-gpus-per-actor", "0", "--ray-cpus-per-actor", "0.5",
                                       "--num-replicas", "2", "--served-model-name", "tiny"), "server")
    ready = threading.Event()
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert wait_until(lambda: ready.is_set() or proc.poll() is not None, 540, poll_s=0.5)
        err.seek(0)
        assert ready.is_set(), f"exit {proc.poll()}: {err.read()[-4000:]}"
        yield {"base": f"http://127.0.0.1:{port}", "proc": proc, "lines": lines}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        err.close()


def test_ready_line_and_chat_completion(server):
    assert "tiny on http://127.0.0.1:" in server["lines"][0] and "2 replica(s), 0 GPU and 0.5 CPU" in server["lines"][0]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello, world!"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server['base']}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(out["choices"][0]["message"]["content"], str)
    assert out["usage"]["completion_tokens"] == 12
    # Serve reserved one group per replica, one bundle per process: replica, target, draft.
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 2
    for g in groups:
        assert g["strategy"] == "PACK"
        assert [g["bundles"][i] for i in sorted(g["bundles"])] == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]


def _ray_metric_sum(port: int, name: str) -> float:
    """Sum of every series of `name` in Ray's metrics export, as `sum(name)` in Prometheus."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_replicas_success_counter_aggregates_in_ray_metrics(cluster, server):
    name = "ray_spec_runtime_request_success_total"
    port = cluster["metrics_port"]
    # Earlier tests' requests count too: wait until they are exported, then count 20 more.
    wait_until(lambda: _ray_metric_sum(port, name) > 0, 60, poll_s=1.0)
    before = _ray_metric_sum(port, name)
    body = {"model": "tiny", "prompt": "One two three", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    def post(_):
        r = httpx.post(f"{server['base']}/v1/completions", json=body, timeout=120)
        return r.status_code, r.text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(20)))
    assert [code for code, _ in answers] == [200] * 20, [text for code, text in answers if code != 200]
    assert wait_until(lambda: _ray_metric_sum(port, name) == before + 20, 60, poll_s=1.0), \
        _ray_metric_sum(port, name)
    # GET /metrics through the proxy reaches one replica, and says so.
    text = httpx.get(f"{server['base']}/metrics", timeout=30).text
    assert text.startswith("# spec-runtime: the metrics of Ray Serve replica ")
    assert "spec_runtime:replica_info{" in text


def _draft_actors() -> list[tuple[str, str]]:
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("spec-runtime-draft-")]


def test_killed_draft_actors_under_load_lose_no_request(server):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    first_chunk = threading.Event()

    def stream(_):
        ids, usage = [], None
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        ids += chunk["choices"][0].get("token_ids") or []
                        first_chunk.set()
                    usage = chunk.get("usage") or usage
        return ids, usage["spec_decode"]["num_ar_fallback_rounds"]

    reference, _ = stream(None)
    assert len(reference) == 150
    first_chunk.clear()
    drafts = _draft_actors()
    assert len(drafts) == 2  # one per replica
    with ThreadPoolExecutor(8) as pool:
        results = pool.map(stream, range(8))
        assert first_chunk.wait(120)
        for name, namespace in drafts:  # both replicas' drafts, wherever Serve sent the requests
            ray.kill(ray.get_actor(name, namespace=namespace))
        results = list(results)
    assert [ids for ids, _ in results] == [reference] * 8  # none lost, none different (greedy is exact)
    assert sum(fallback for _, fallback in results) > 0  # they decoded without a draft for a while
    # Each replica places a new draft in the same bundle (a new name).
    assert wait_until(lambda: len(_draft_actors()) == 2 and not set(drafts) & set(_draft_actors()), 120,
                      poll_s=0.5)


def test_sigint_stops_the_application(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 0
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith("spec-runtime-")], names


def test_two_models_behind_one_router_answer_by_name(cluster, tmp_path):
    from ray import serve

    from e2e_util import make_config
    from spec_runtime.ray import build_openai_app
    from spec_runtime.ray.router import ModelServeConfig

    llama = cluster["model"]
    qwen = save_tiny_model(tmp_path / "q", "qwen2", seed=1)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_openai_app([
            ModelServeConfig(make_config(llama, llama, mode="sd"), "llama", gpus_per_actor=0, cpus_per_actor=0.5,
                             replica_cpus=0.5),
            ModelServeConfig(make_config(qwen, qwen, mode="sd"), "qwen", gpus_per_actor=0, cpus_per_actor=0.5,
                             replica_cpus=0.5),
        ])
        serve.run(app, name="router", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        listed = httpx.get(f"{base}/v1/models", timeout=60).json()
        assert sorted(m["id"] for m in listed["data"]) == ["llama", "qwen"]
        roots = {m["id"]: m["root"] for m in listed["data"]}
        assert roots == {"llama": llama, "qwen": qwen}
        for name in ("llama", "qwen"):
            body = {"model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name and r.json()["usage"]["completion_tokens"] == 6
            # Streamed through the router chunk by chunk, ending as OpenAI's streams end.
            with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True},
                              timeout=120) as s:
                assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 3
        r = httpx.post(f"{base}/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        h = httpx.get(f"{base}/health", timeout=30)
        assert h.status_code == 200 and set(h.json()["models"]) == {"llama", "qwen"}
    finally:
        serve.shutdown()


def test_replica_that_cannot_load_ends_the_command_with_its_error(cluster, tmp_path):
    missing = str(tmp_path / "no-such-model")
    argv = _command(cluster, _free_port(), "--ray-gpus-per-actor", "0", "--ray-cpus-per-actor", "0.5")
    argv[argv.index("--target") + 1] = missing
    proc, err = _run(cluster, argv, "missing")
    out, _ = proc.communicate(timeout=600)
    err.seek(0)
    msg = err.read()
    assert proc.returncode == 1, msg[-4000:]
    (line,) = [x for x in msg.splitlines() if x.startswith("spec-runtime: start-up failed: ")]
    assert "Ray Serve could not deploy the application" in line and "failed to start 3 times" in line
    assert "Last error: spec_runtime.launcher.StartupError: target actor" in line
    assert f"FileNotFoundError: model path '{missing}' does not exist" in line
    assert "serving" not in out
