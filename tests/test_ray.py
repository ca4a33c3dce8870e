"""Ray deployment on the CPU: Ray's GPUs are logical here, the models run on "cpu".

One local Ray instance (4 CPUs, 2 logical GPUs) serves the first tests; the last test
stops it and starts a simulated two-node cluster. Greedy output is compared with the
local launcher's on the same tiny model (greedy speculative decoding is exact, so it is
also target-only output).
"""

from __future__ import annotations

import dataclasses
import socket
import threading

import httpx
import numpy as np
import pytest
import zmq

import ray  # the `test` extra installs ray[serve]

from conftest import save_tiny_model
from e2e_util import Borrowed, make_config, random_prompts, wait_until
from protocol.codec import encode
from protocol.messages import GenerateRequest, SamplingParams
from protocol.transport import curve_keypair, set_curve_client
from spec_runtime.client import Client
from spec_runtime.ray import PlacementError, deploy

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("ray") / "t", "llama")
    cfg = make_config(target, target, mode="sd", k=3)
    prompts = random_prompts(384, seed=3)
    with Client(cfg) as local:
        reference = [r.token_ids for r in local.generate_batch(prompts, LONG)]
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield cfg, prompts, reference
    ray.shutdown()


@pytest.fixture(scope="module")
def deployment(setup):
    cfg, _, _ = setup
    dep = deploy(cfg, "pack")
    yield dep
    dep.shutdown()


def _stream_all(client, prompts, fault=None):
    """Generate all prompts at once; call fault() once tokens stream. Returns (ids, final stats)."""
    rids = [client.submit(p, LONG) for p in prompts]
    results: dict[str, tuple] = {}
    started = threading.Event()

    def consume(rid):
        ids, last = [], None
        for out in client.stream_outputs(rid, timeout_s=60):
            ids.extend(out.new_token_ids)
            last = out
            started.set()
        results[rid] = (ids, last.stats)

    threads = [threading.Thread(target=consume, args=(r,)) for r in rids]
    for t in threads:
        t.start()
    assert started.wait(60)
    if fault is not None:
        fault()
    for t in threads:
        t.join(120)
    return [results[r][0] for r in rids], [results[r][1] for r in rids]



def test_two_gpus_one_node_matches_local_launcher(setup, deployment):
    _, prompts, reference = setup
    assert deployment.gpu_ids() == {"target": "0", "draft": "1"}
    assert deployment.transports == {"spec": "ipc", "client": "ipc"}
    with Client(deployment.cfg, launcher=Borrowed(deployment)) as client:
        ids, stats = _stream_all(client, prompts)
        assert ids == reference
        assert sum(s.num_draft_tokens for s in stats) > 0  # the draft actor really speculated


def test_actors_show_no_progress_bars(deployment):
    # tqdm reads TQDM_DISABLE when it is imported: the actor's environment must carry it.
    def bar_disabled(_actor):
        from tqdm.auto import tqdm

        return tqdm(range(2)).disable

    for actor in deployment.actors.values():
        assert ray.get(actor.__ray_call__.remote(bar_disabled), timeout=30) is True


def test_unsatisfiable_placement_names_asked_and_available(setup):
    cfg, _, _ = setup
    with pytest.raises(PlacementError) as e:
        deploy(cfg, "spread", gpus_per_actor=2, placement_timeout_s=2.0)
    msg = str(e.value)
    assert "(strategy SPREAD) on this cluster" in msg
    assert "need {CPU: 2, GPU: 4} in all" in msg  # asked for in all
    assert "the cluster has {CPU: 4, GPU: 2}" in msg  # what the cluster has
    assert "ray start --num-gpus" in msg


def test_placement_held_by_other_work_times_out_naming_what_is_free(setup, deployment):
    cfg, _, _ = setup
    with pytest.raises(PlacementError) as e:  # the deployment fixture holds both GPUs
        deploy(cfg, "pack", gpus_per_actor=1, placement_timeout_s=2.0)
    msg = str(e.value)
    assert "within 2 s" in msg and "bundle 0 {'CPU': 1.0, 'GPU': 1.0} does not fit in what is free" in msg
    assert "'GPU': 0.0" in msg  # free now


def test_killed_draft_actor_degrades_then_is_replaced(setup, deployment):
    _, prompts, reference = setup
    with Client(deployment.cfg, launcher=Borrowed(deployment)) as client:
        old = deployment.actors["draft"]
        old_pid = deployment.pids()["draft"]
        ids, stats = _stream_all(client, prompts, fault=lambda: ray.kill(old))
        assert ids == reference  # nothing lost, nothing different
        assert sum(s.num_ar_fallback_rounds for s in stats) > 0  # it decoded without the draft for a while
        assert wait_until(lambda: deployment.num_draft_restarts == 1, 120, poll_s=0.1)
        assert deployment.pids()["draft"] != old_pid and deployment.dead_child() is None
        assert deployment.gpu_ids()["draft"] == "1"  # same bundle
        # Speculation resumes over the same address.
        assert wait_until(lambda: client.engine_stats().draft_alive, 30, poll_s=0.1)
        ids, stats = _stream_all(client, prompts)
        assert ids == reference
        assert sum(s.num_draft_tokens for s in stats) > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_app_answers_and_health_fails_with_dead_target(setup, deployment):
    from ray import serve
    from spec_runtime.ray.serve_app import build_application

    cfg, prompts, reference = setup
    deployment.shutdown()  # frees the two logical GPUs; the replica runs a CPU-only deployment
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_application(cfg, gpus_per_actor=0, cpus_per_actor=1), name="spec", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        body = {"model": cfg.target.path, "prompt": prompts[0], "max_tokens": 20, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference[0][:20]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        # Kill the replica's target actor: the health check fails and Serve replaces the replica,
        # whose new deployment has a new placement group (so a new target name).
        (old,) = _target_actors()
        ray.kill(ray.get_actor(old[0], namespace=old[1]))

        def replaced():
            names = _target_actors()
            return len(names) == 1 and names[0] != old

        assert wait_until(replaced, 90, poll_s=0.1)
        assert wait_until(lambda: _ok(f"{base}/health"), 90, poll_s=0.1)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == reference[0][:20]
    finally:
        serve.shutdown()


def _target_actors() -> list[tuple[str, str]]:
    """(name, namespace) of the live target actors (from the GCS: no dashboard needed)."""
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("spec-runtime-target-")]


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_nodes_spread_uses_tcp_with_curve(setup):
    from ray.cluster_utils import Cluster

    cfg, prompts, reference = setup
    # Over CURVE the DraftLink sees the tcp connect before the handshake, so its first send to a
    # new draft fails and the draft is suspect until a probe answers (one draft_timeout_s).
    cfg = cfg.replace(spec=dataclasses.replace(cfg.spec, draft_timeout_s=1.0))
    ray.shutdown()
    # The driver's node has no GPU, so both links cross nodes.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, num_gpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        dep = deploy(cfg, "spread")
        try:
            assert dep.where["target"]["node_id"] != dep.where["draft"]["node_id"]
            assert dep.transports == {"spec": "tcp", "client": "tcp"}
            assert dep.client_addr.startswith("tcp://") and dep.client_curve_server_key
            assert not _answered(dep.client_addr, None)  # no CURVE at all
            assert not _answered(dep.client_addr, curve_keypair()[0])  # the wrong server key
            assert _answered(dep.client_addr, dep.client_curve_server_key)  # control: the right key
            with Client(cfg, launcher=Borrowed(dep)) as client:
                ids, stats = _stream_all(client, prompts[:2])
                assert ids == reference[:2]
                assert sum(s.num_draft_tokens for s in stats) > 0  # the spec link works over CURVE too
                # A new draft binds the same tcp address with the same keys; the target reconnects.
                # Killed mid-generation: see the report on a draft killed while the target is idle.
                ids, _ = _stream_all(client, prompts[:2], fault=lambda: ray.kill(dep.actors["draft"]))
                assert ids == reference[:2]
                assert wait_until(lambda: dep.num_draft_restarts == 1, 120, poll_s=0.1)
                assert wait_until(lambda: client.engine_stats().draft_alive, 30, poll_s=0.1)
                ids, stats = _stream_all(client, prompts[:2])
                assert ids == reference[:2]
                assert sum(s.num_draft_tokens for s in stats) > 0
                assert dep.where["draft"]["node_id"] != dep.where["target"]["node_id"]
        finally:
            dep.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


def _answered(address: str, server_key: bytes | None) -> bool:
    """Whether a bare DEALER with this server key (None: no CURVE) completes its handshake
    and gets an answer to a request within 3 s."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        if server_key is not None:
            set_curve_client(sock, server_key)
        sock.connect(address)
        req = GenerateRequest("stray", np.asarray([5, 6, 7], dtype=np.int64), SamplingParams(max_tokens=4))
        sock.send_multipart(encode(req), copy=False)
        answered = bool(sock.poll(3000, zmq.POLLIN))
        handshake = bool(monitor.poll(0))
        assert answered == handshake, (answered, handshake)
        return answered
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
