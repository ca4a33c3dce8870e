"""Malformed input on target_proc's live sockets, and out-of-range values in valid requests.

  - target_proc's client ROUTER, fuzzed with hypothesis (>= 1000 cases) through a raw
    DEALER connected to launcher.client_addr;
  - target_proc's end of the spec link (DraftLink), with this test as a fake draft.
Every malformed message must be answered with an ErrorReply (or, for the DraftLink,
dropped with a log line), and a real request afterwards must still succeed. Out-of-range
values (a token id >= vocab, stop ids out of range, sampling values past what the code
can represent) reject only the request that carries them. The draft's socket is fuzzed
in test_abuse_draft.py; the strategies live in fuzz_util.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zmq
from e2e_util import make_config, random_prompts
from fuzz_util import (
    OTHER_LINK_SAMPLES,
    PWNED,
    K,
    expect_error,
    frames,
    fuzz_socket,
    garbage,
)

from protocol import messages as m
from protocol.codec import Decoder
from protocol.transport import Channel, ipc_address, private_ipc_dir
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


@pytest.fixture(scope="module")
def client(models):
    target, draft = models
    cfg = make_config(target, draft, mode="sd", k=K).replace(sched=SchedulerConfig(max_batch_size=4, max_model_len=128, spec_policy="always"))
    with Client(cfg) as c:
        yield c


def _raw_dealer(client) -> Channel:
    chan = Channel(zmq.DEALER, m.TargetToClientMessage)
    chan.connect(client.launcher.client_addr)
    return chan


# ---------------------------------------------------------------- target's client ROUTER


def test_fuzz_target_client_router(client):
    prompt = random_prompts(384, lengths=(9,), seed=3)[0]
    sp = m.SamplingParams(max_tokens=8, ignore_eos=True)
    before = client.generate(prompt, sp).token_ids
    pids = client.launcher.pids()
    valid = [frames(m.GenerateRequest(request_id="r", prompt_token_ids=np.array(prompt), sampling=sp)),
             frames(m.AbortRequest(request_id="r")), frames(m.StatsRequest())]
    with _raw_dealer(client) as raw:
        n = fuzz_socket(lambda f: (raw.socket.send_multipart(f), expect_error(raw, "client link")),
                        garbage(valid), Decoder(m.ClientMessage))
    assert n >= 1000
    assert not os.path.exists(PWNED)
    # An oversized frame: libzmq drops the sender (ZMQ_MAXMSGSIZE) before allocating it.
    with _raw_dealer(client) as big:
        big.socket.send_multipart([b"\x00" * (64 << 20) + b"\x00"])
        assert big.recv(timeout_s=0.5) is None
    assert client.generate(prompt, sp).token_ids == before
    assert client.launcher.pids() == pids and client.launcher.dead_child() is None


def test_out_of_range_requests_rejected_alone(client):
    """One burst from one client: the bad requests get ErrorReply naming them, the good
    ones interleaved with them finish with their exact token counts."""
    good = {f"ok{i}": p for i, p in enumerate(random_prompts(384, lengths=(4, 7, 11), seed=5))}
    sp = m.SamplingParams(max_tokens=6, ignore_eos=True)
    bad = {
        "vocab": (np.array([5, 384, 6]), sp),
        "negative": (np.array([5, -1]), sp),
        "stop-ids": (np.array([5, 6]), m.SamplingParams(max_tokens=4, stop_token_ids=[3, 10**6])),
        "stop-neg": (np.array([5, 6]), m.SamplingParams(max_tokens=4, stop_token_ids=[-2])),
        "neg-len": (np.array([5, 6]), m.SamplingParams(max_tokens=-3)),
        "too-long": (np.array([5] * 120), m.SamplingParams(max_tokens=9)),
        "2d": (np.ones((2, 2), np.int64), sp),
        "float": (np.array([1.5, 2.0], np.float32), sp),
        "top-k-huge": (np.array([5, 6]), m.SamplingParams(max_tokens=4, temperature=1.0, top_k=2**63)),
        "seed-huge": (np.array([5, 6]), m.SamplingParams(max_tokens=4, temperature=1.0, seed=2**64 - 1)),
        "top-p-nan": (np.array([5, 6]), m.SamplingParams(max_tokens=4, top_p=float("nan"))),
        "temp-inf": (np.array([5, 6]), m.SamplingParams(max_tokens=4, temperature=float("inf"))),
    }
    with _raw_dealer(client) as raw:
        order = list(bad.items())
        for i, (rid, p) in enumerate(good.items()):
            raw.send(m.GenerateRequest(request_id=rid, prompt_token_ids=np.array(p), sampling=sp))
            for name, (ids, bsp) in order[i::len(good)]:
                raw.send(m.GenerateRequest(request_id=name, prompt_token_ids=ids, sampling=bsp))
        tokens: dict[str, list[int]] = {rid: [] for rid in good}
        errors: dict[str, str] = {}
        finished: dict[str, str] = {}
        while len(finished) < len(good) or len(errors) < len(bad):
            msg = raw.recv(timeout_s=30)
            assert msg is not None, f"stuck: finished {finished}, errors {sorted(errors)}"
            if isinstance(msg, m.ErrorReply):
                assert msg.code == "bad_request" and msg.request_id in bad, msg
                errors[msg.request_id] = msg.message
            else:
                for out in msg.outputs:
                    assert out.request_id in good, out
                    tokens[out.request_id] += out.new_token_ids
                    if out.finished:
                        finished[out.request_id] = out.finish_reason
    assert finished == {rid: "length" for rid in good}
    assert all(len(t) == 6 for t in tokens.values())
    ref = client.generate_batch(list(good.values()), sp)
    assert [r.token_ids for r in ref] == [tokens[rid] for rid in good]
    assert "[0, 384)" in errors["vocab"] and "stop token id" in errors["stop-ids"]
    assert client.launcher.dead_child() is None


# ---------------------------------------------------------------- target's end of the spec link


def test_fuzz_target_spec_link_end(tmp_path):
    """target_proc's DraftLink with this test as the draft: garbage from the draft is dropped
    with a log line, and the next real speculation is still taken."""
    from target_proc.draft_link import DraftLink

    ipc_dir = private_ipc_dir()
    addr = ipc_address(ipc_dir, "spec")
    fake_draft = Channel(zmq.PAIR, m.SpecLinkToDraft)
    fake_draft.bind(addr)
    link = DraftLink(Channel(zmq.PAIR, m.SpecLinkToTarget), addr, timeout_s=5.0, k=K)
    link.wait_connected(5.0)
    rounds = iter(range(1, 10**6))
    valid = [frames(x) for x in OTHER_LINK_SAMPLES if isinstance(x, (m.SpecResponse, m.DraftStats))]

    def check(frames):
        r = next(rounds)
        fake_draft.socket.send_multipart(frames)
        fake_draft.send(m.SpecResponse(step=r, seq_ids=np.array([7]), rounds=np.array([r]),
                                       draft_token_ids=np.array([[4, 5, 6]]), num_draft_tokens=np.array([3], np.int32),
                                       cache_hit=np.array([True])))
        got = link.wait_speculations({7: r})
        assert list(got) == [7] and got[7].draft_token_ids.tolist() == [4, 5, 6] and link.alive

    try:
        assert fuzz_socket(check, garbage(valid), Decoder(m.SpecLinkToTarget)) >= 1000
        assert not link.desynced and link.num_timeouts == 0
    finally:
        link.channel.close()
        fake_draft.close()
