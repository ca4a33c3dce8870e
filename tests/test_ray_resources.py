"""Resources of a Ray deployment (auto GPUs/CPUs, fit checks) and the refusal of flags
that `serve --ray` or the local server would not honour: no cluster needed."""

from __future__ import annotations

import pytest

from spec_runtime.cli import main
from spec_runtime.ray.resources import ActorResources, replica_bundles, resolve, unfit_reason


def _node(cpu: float, gpu: float = 0.0, ip: str = "10.0.0.1", alive: bool = True) -> dict:
    res = {"CPU": cpu}
    if gpu:
        res["GPU"] = gpu
    return {"Alive": alive, "NodeManagerAddress": ip, "Resources": res}


def test_auto_gives_no_gpus_with_a_warning_where_the_cluster_has_none():
    res, warnings = resolve(None, None, {"CPU": 8.0}, num_actors=2)
    assert res == ActorResources(gpus=0.0, cpus=1.0, replica_cpus=1.0)
    assert len(warnings) == 1 and "no GPUs" in warnings[0] and "--ray-gpus-per-actor" in warnings[0]


def test_auto_gives_a_gpu_per_actor_where_there_are_gpus():
    res, warnings = resolve(None, None, {"CPU": 8.0, "GPU": 2.0}, num_actors=2)
    assert (res.gpus, res.cpus, warnings) == (1.0, 1.0, [])


def test_auto_cpus_share_a_small_cluster_and_say_so():
    res, warnings = resolve(0, None, {"CPU": 2.0}, num_actors=2)
    assert res.cpus == 0.5 and res.replica_cpus + 2 * res.cpus <= 2.0
    assert len(warnings) == 1 and "--ray-cpus-per-actor" in warnings[0]


def test_given_values_are_kept_without_warnings():
    res, warnings = resolve(0.5, 2.0, {"CPU": 1.0}, num_actors=1)
    assert (res.gpus, res.cpus, warnings) == (0.5, 2.0, [])


@pytest.mark.parametrize("gpus, cpus", [(-1, 1), (1, -1), (1.5, 1), (0, 0)])
def test_bad_actor_resources_are_refused(gpus, cpus):
    with pytest.raises(ValueError):
        ActorResources(gpus=gpus, cpus=cpus)


def test_replica_bundles_one_per_process():
    assert replica_bundles(ActorResources(gpus=1, cpus=2, replica_cpus=0.5), 2) == [
        {"CPU": 0.5}, {"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert replica_bundles(ActorResources(gpus=0, cpus=1), 1) == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_unfit_names_the_bundle_and_the_nodes():
    bundles = replica_bundles(ActorResources(gpus=1, cpus=1), 2)
    reason = unfit_reason(bundles, 1, [_node(4.0), _node(64.0, alive=False)])
    assert reason.startswith("bundle 1 {CPU: 1, GPU: 1} fits on no node")
    assert "10.0.0.1 {CPU: 4, GPU: 0}" in reason


def test_unfit_counts_every_replica_against_the_cluster():
    bundles = replica_bundles(ActorResources(gpus=1, cpus=1), 2)
    nodes = [_node(8.0, 2.0), _node(8.0, 1.0, ip="10.0.0.2")]
    assert unfit_reason(bundles, 1, nodes) is None
    reason = unfit_reason(bundles, 2, nodes)
    assert "need {CPU: 6, GPU: 4} in all" in reason and "the cluster has {CPU: 16, GPU: 3}" in reason


@pytest.mark.parametrize("argv, flag", [
    (["--ray", "--on-target-death", "stay"], "--on-target-death"),
    (["--ray", "--uvicorn-log-level", "info"], "--uvicorn-log-level"),
    (["--num-replicas", "2"], "--num-replicas"),
    (["--ray-gpus-per-actor", "0"], "--ray-gpus-per-actor"),
    (["--ray-address", "auto"], "--ray-address"),
])
def test_serve_refuses_flags_it_would_not_honour(argv, flag, capsys):
    assert main(["serve", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and ("does not apply with --ray" in err or "needs --ray" in err)


def test_every_server_metric_has_a_ray_twin_of_the_same_name():
    from spec_runtime.ray.metrics import RayMetrics
    from spec_runtime.server.metrics import ServerMetrics

    server = {f.name.replace(":", "_") for f in ServerMetrics("m", 3).registry.collect()}
    twins = {m._name for m in vars(RayMetrics("m", 3)).values() if hasattr(m, "_name")}
    assert server == twins


def test_serve_failure_summary_keeps_the_first_line_and_the_last_error():
    from spec_runtime.ray.launch import _summary

    message = ("DEPLOY_FAILED The deployment failed to start 3 times in a row.\n"
               "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
               "FileNotFoundError: model path '/m' does not exist\n"
               "The above exception was the direct cause of the following exception:\n"
               "spec_runtime.launcher.StartupError: target actor (node 10.0.0.1, pid 7): FileNotFoundError: x\n")
    assert _summary(message) == ("DEPLOY_FAILED The deployment failed to start 3 times in a row. Last error: "
                                 "spec_runtime.launcher.StartupError: target actor (node 10.0.0.1, pid 7): "
                                 "FileNotFoundError: x")
    assert _summary("DEPLOY_FAILED no traceback") == "DEPLOY_FAILED no traceback"


def _tp_config(tp: int, mode: str = "sd", device: str = "cuda"):
    from spec_runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig

    return RuntimeConfig(target=ModelConfig(path="/m/70b", device=device, tensor_parallel_size=tp),
                         draft=ModelConfig(path="/m/1b" if mode != "ar" else "", device=device),
                         spec=SpeculativeConfig(mode=mode))


@pytest.mark.parametrize("tp, mode, roles", [
    (1, "sd", ["target", "draft"]),
    (4, "ssd", ["target", "target-rank1", "target-rank2", "target-rank3", "draft"]),
    (2, "ar", ["target", "target-rank1"]),
])
def test_a_tensor_parallel_target_takes_a_bundle_per_rank_and_the_draft_the_last(tp, mode, roles):
    from spec_runtime.ray.deploy import roles_of
    from spec_runtime.ray.serve_app import build_application

    cfg = _tp_config(tp, mode)
    assert roles_of(cfg) == roles
    res = ActorResources(gpus=1, cpus=2, replica_cpus=1)
    want = [{"CPU": 1.0}] + [{"CPU": 2.0, "GPU": 1.0}] * len(roles)
    assert replica_bundles(res, len(roles_of(cfg))) == want
    # The Serve deployment asks Ray for exactly that group: TP=4 + draft on 5 GPUs.
    app = build_application(cfg, gpus_per_actor=1, cpus_per_actor=2, placement="pack")
    rep = app._bound_deployment._replica_config
    assert rep.placement_group_bundles == want and rep.placement_group_strategy == "PACK"
    assert sum(b.get("GPU", 0) for b in rep.placement_group_bundles) == tp + (mode != "ar")


def test_tensor_parallel_ranks_need_whole_gpus():
    from spec_runtime.ray.serve_app import resolve_resources

    with pytest.raises(ValueError, match="a whole GPU per rank"):
        resolve_resources(_tp_config(2), 0.5, 1.0)
    resolve_resources(_tp_config(2, device="cpu"), 0.0, 1.0)  # gloo on the CPU: no GPU at all
    resolve_resources(_tp_config(1), 0.5, 1.0)  # one rank may share a GPU


def test_serve_ray_accepts_tensor_parallel(monkeypatch):
    calls = []
    monkeypatch.setattr("spec_runtime.ray.launch.run_ray_server", lambda cfg, options, **kw: calls.append(cfg) or 0)
    assert main(["serve", "--ray", "-tp", "2", "--target", "random:target-8b", "--draft", "ngram",
                 "--ray-gpus-per-actor", "1"]) == 0
    assert calls[0].target.tensor_parallel_size == 2


def test_rank_roles_and_their_devices():
    import dataclasses

    from spec_runtime.ray.actors import pin_device, rank_of, rank_role

    assert rank_role(3) == "target-rank3" and rank_of("target-rank3") == 3
    assert rank_of("target") is None and rank_of("draft") is None
    cfg = _tp_config(2)
    pinned = pin_device(cfg.replace(target=dataclasses.replace(cfg.target, device="cuda:3")), "target-rank1")
    assert pinned.target.device == "cuda:0" and pinned.draft == cfg.draft


def test_the_ray_twins_follow_the_engine_counters_and_the_round_choice():
    from protocol.messages import EngineStats, RequestStats
    from spec_runtime.ray.metrics import RayMetrics
    from spec_runtime.server.metrics import ServerMetrics

    class Recorder(RayMetrics):
        def __init__(self):
            super().__init__("m", 3)
            self.incs, self.choices = [], []

        def inc_counter(self, attr, value):
            self.incs.append((attr, value))

        def set_round_choices(self, choices):
            self.choices.append(dict(choices))

    ray_twin = Recorder()
    server = ServerMetrics("m", 3, mirror=ray_twin)
    base = dict(num_running=1, num_waiting=0, num_free_slots=1, draft_alive=True, mode="ssd", totals=RequestStats())
    server.observe_engine(EngineStats(**base, prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1,
                                      num_sd_rounds=2, round_choices={4: "sd"}))
    server.observe_engine(EngineStats(**base, prefix_cache_queries=16, prefix_cache_hits=4, num_preemptions=1,
                                      num_sd_rounds=5, round_choices={4: "plain"}))
    assert sorted(ray_twin.incs) == sorted([("prefix_cache_queries", 10), ("prefix_cache_hits", 4),
                                            ("preemptions", 1), ("sd_steps", 2), ("prefix_cache_queries", 6),
                                            ("sd_steps", 3)])
    assert ray_twin.choices == [{4: "sd"}, {4: "plain"}]


@pytest.mark.parametrize("target_dev, draft_dev, tp", [("cuda", "cuda", 1), ("cuda:0", "cuda:1", 1), ("cuda:0", "cuda:2", 2)])
def test_an_actor_with_whole_gpus_reads_the_other_role_as_elsewhere(target_dev, draft_dev, tp):
    """Inside an actor its own model is on cuda:0 and the other role's keeps its host-wide name: with
    target and draft both "cuda" (docs/ray.md's example), or the draft pinned beside a target on
    cuda:0, the config read them as one GPU, and the target's round policy ran no SSD rounds. An
    actor with whole GPUs of its own names the other role's device past its own."""
    import dataclasses

    from spec_runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig
    from spec_runtime.ray.actors import pin_device
    from target_proc.round_policy import RoundPolicy

    cfg = RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=4), draft=ModelConfig(path="d", device=draft_dev),
                        target=dataclasses.replace(ModelConfig(path="t", device=target_dev), tensor_parallel_size=tp))
    for role in ("target", "draft"):
        assert not pin_device(cfg, role, own_gpus=True).draft_shares_target_gpu
        shared = pin_device(cfg, role).draft_shares_target_gpu  # a fractional GPU: it may be shared
        assert shared == (role == "draft" or target_dev == draft_dev)
    kinds = {o.kind for o in RoundPolicy.for_config(pin_device(cfg, "target", own_gpus=True)).options(4)}
    assert "ssd" in kinds
