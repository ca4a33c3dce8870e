"""A tensor-parallel target on Ray, on the CPU: one actor per rank, each in its own bundle,
the draft in the last; the ranks meet rank 0 over gloo. Greedy output equals the local
launcher's at one rank, and a dead rank is a dead target.
"""

from __future__ import annotations

import dataclasses

import pytest

import ray  # the `test` extra installs ray[serve]

from conftest import save_tiny_model
from e2e_util import Borrowed, make_config, perturbed_copy, random_prompts, wait_until
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.ray import deploy

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-tp")
    target = save_tiny_model(root / "t", "llama")
    draft = perturbed_copy(target, str(root / "d"), noise=0.3)
    cfg = make_config(target, draft, mode="sd", k=3)
    prompts = random_prompts(384, lengths=(6, 11), seed=7)
    with Client(cfg) as local:
        reference = [r.token_ids for r in local.generate_batch(prompts, GREEDY)]
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield cfg, prompts, reference
    ray.shutdown()


def test_two_ranks_and_a_draft_on_ray_match_one_rank_locally(setup):
    cfg, prompts, reference = setup
    cfg2 = cfg.replace(target=dataclasses.replace(cfg.target, tensor_parallel_size=2))
    dep = deploy(cfg2, gpus_per_actor=0, cpus_per_actor=1)
    try:
        assert list(dep.actors) == ["target", "target-rank1", "draft"]
        assert [b["CPU"] for b in dep.placement_group.bundle_specs] == [1.0, 1.0, 1.0]
        assert dep.tp_rendezvous[0] == "127.0.0.1"  # one node: loopback
        client = Client(dep.cfg, launcher=Borrowed(dep))
        assert [r.token_ids for r in client.generate_batch(prompts, GREEDY)] == reference
        # A dead rank is a dead target: the requests fail, dead_child() says so.
        ray.kill(dep.actors["target-rank1"])
        assert wait_until(lambda: dep.dead_child() == "target", 30)
        with pytest.raises(Exception, match="(?i)target"):
            client.generate(prompts[0], GREEDY)
    finally:
        dep.shutdown()


