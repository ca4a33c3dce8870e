"""Stops that fall inside an accepted chunk cut the output exactly there.

With draft == target every round accepts all K = 8 drafts, so a stop token, a stop
string or max_tokens almost always lands in the middle of a chunk of 9 tokens.
"""

from __future__ import annotations

import pytest

from conftest import save_tiny_model
from e2e_util import make_config, random_prompts
from protocol.messages import SamplingParams
from spec_runtime.client import Client

K = 8


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("stops") / "m", "llama")
    with Client(make_config(target, target, mode="sd", k=K)) as client:
        yield client


@pytest.fixture(scope="module")
def free_run(runtime):
    prompt = random_prompts(384, lengths=(12,), seed=3)[0]
    res = runtime.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    assert res.stats.num_accepted_tokens == res.stats.num_draft_tokens  # full chunks
    return prompt, res


def test_max_tokens_inside_chunk(runtime, free_run):
    prompt, full = free_run
    for n in (1, 5, 13, 22):
        res = runtime.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        assert res.token_ids == full.token_ids[:n]
        assert res.finish_reason == "length"


def test_stop_token_inside_chunk(runtime, free_run):
    prompt, full = free_run
    ids = full.token_ids
    # A token whose first occurrence is well inside the run and not at a chunk edge.
    idx = next(i for i in range(11, len(ids)) if ids.index(ids[i]) == i and i % (K + 1) not in (0, K))
    res = runtime.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=[ids[idx]]))
    assert res.token_ids == ids[: idx + 1]
    assert res.finish_reason == "stop"


def test_eos_inside_chunk(runtime, free_run):
    # Make the tokenizer's EOS irrelevant: use the run's own token as an extra EOS via
    # stop_token_ids, and check plain EOS handling separately: ignore_eos=False must
    # stop at the first EOS (id 2) if the run produces one, else run to max_tokens.
    prompt, full = free_run
    res = runtime.generate(prompt, SamplingParams(max_tokens=60))
    if 2 in full.token_ids:
        cut = full.token_ids.index(2) + 1
        assert res.token_ids == full.token_ids[:cut] and res.finish_reason == "stop"
    else:
        assert res.token_ids == full.token_ids and res.finish_reason == "length"


def test_stop_string_inside_chunk(runtime, free_run):
    prompt, full = free_run
    text = full.text
    assert len(text) > 20
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    res = runtime.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop]))
    assert res.text == text[:cut]
    assert res.finish_reason == "stop"
    # No token after the one that completed the stop string.
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert stop in runtime.tokenizer.decode(res.token_ids)
    assert stop not in runtime.tokenizer.decode(res.token_ids[:-1])


def test_streaming_yields_chunks_that_add_up(runtime, free_run):
    prompt, full = free_run
    chunks = list(runtime.stream(prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    assert len(chunks) > 1
    assert [t for c in chunks for t in c.new_token_ids] == full.token_ids[:30]
    assert "".join(c.text_delta for c in chunks) == runtime.tokenizer.decode(full.token_ids[:30], skip_special_tokens=True)
    assert chunks[-1].finished and chunks[-1].stats is not None


def test_logprobs_are_the_targets_and_match_ar(tmp_path_factory, runtime, free_run):
    """logprobs of the generated tokens are the target's (here: greedy, its raw
    log-softmax), whether a token came from a draft or from the target's own step."""
    import math

    prompt, full = free_run
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=True)
    res = runtime.generate(prompt, sp)
    assert res.token_ids == full.token_ids[:20]
    assert len(res.logprobs) == 20 and all(lp <= 0.0 for lp in res.logprobs)
    target = runtime.config.target.path
    with Client(make_config(target, mode="ar")) as ar_client:
        ar = ar_client.generate(prompt, sp)
    assert ar.token_ids == res.token_ids
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ar.logprobs, res.logprobs))
