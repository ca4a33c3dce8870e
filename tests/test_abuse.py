"""Malformed input on every live socket, and out-of-range values inside valid messages.

Live sockets, each fuzzed with hypothesis (>= 1000 cases) while its process serves:
  - target_proc's client ROUTER, through a raw DEALER connected to launcher.client_addr;
  - draft_proc's spec PAIR, with the real draft (draft_proc.__main__.build over a tiny
    model, SSD mode) running its run_forever loop in a thread of this process, and this
    test as its peer;
  - target_proc's end of the spec link (DraftLink), with this test as a fake draft.
Every malformed message must be answered with an ErrorReply (or, for the DraftLink,
dropped with a log line), and a real request afterwards must still succeed.

Out-of-range values (a token id >= vocab, stop ids out of range, K above the configured
one, an unknown seq_id, a negative length, more accepted tokens than proposed, sampling
values past what the code can represent) reject only the request that carries them.
"""

from __future__ import annotations

import os
import pickle
import threading

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import save_tiny_model
from e2e_util import make_config, perturbed_copy, random_prompts
from protocol import messages as m
from protocol.codec import DEFAULT_MAX_FRAMES, Decoder, ProtocolError, encode, encode_config
from protocol.transport import Channel, ipc_address, private_ipc_dir
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig

K = 3
FUZZ = settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
PWNED = "/tmp/spec-runtime-abuse-pwned"


# ---------------------------------------------------------------- garbage frames


def _frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


class _Evil:
    """Unpickling this runs a command: proof that no socket ever unpickles."""

    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=10,
)
_tags = st.sampled_from(["gen", "abort", "stats?", "bye", "req", "add", "rel", "dstats?", "resp", "dstats",
                         "error", "out", "stats", "hello", "init", "ready", "nope", ""])


def garbage(valid: list[list[bytes]]):
    """Frames that must not decode: random bytes, truncated or mangled valid messages,
    unknown tags, valid msgpack in the wrong schema, messages of the other links, pickles,
    too many frames."""
    base = st.sampled_from(valid)

    @st.composite
    def mangled(draw):
        frames = list(draw(base))
        i = draw(st.integers(0, len(frames) - 1))
        data = bytearray(frames[i])
        op = draw(st.sampled_from(["truncate", "flip", "insert", "drop", "extra"]))
        if op == "truncate":
            data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
        elif op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif op == "insert":
            j = draw(st.integers(0, len(data)))
            data[j:j] = draw(st.binary(min_size=1, max_size=6))
        elif op == "drop" and len(frames) > 1:
            return frames[:i] + frames[i + 1:]
        elif op == "extra":
            return frames + [draw(st.binary(max_size=16))]
        frames[i] = bytes(data)
        return frames

    schema = st.builds(lambda tag, rest, extra: [msgspec.msgpack.encode([tag, *rest]), *extra],
                       _tags, st.lists(_values, max_size=8), st.lists(st.binary(max_size=16), max_size=3))
    other_links = st.sampled_from([_frames(x) for x in _OTHER_LINK_SAMPLES])
    pickles = st.builds(lambda obj, proto: [pickle.dumps(obj, protocol=proto)],
                        _values | st.just(_Evil()) | st.just(m.StatsRequest()), st.integers(0, 5))
    too_many = st.integers(DEFAULT_MAX_FRAMES + 1, DEFAULT_MAX_FRAMES + 8).map(lambda n: [b"\x91\xa6stats?"] * n)
    return st.one_of(st.lists(st.binary(max_size=64), min_size=1, max_size=5), mangled(), schema, other_links,
                     pickles, too_many)


_OTHER_LINK_SAMPLES = [
    m.Hello(protocol_version=m.PROTOCOL_VERSION, role="draft", pid=1),
    m.Init(protocol_version=m.PROTOCOL_VERSION, config={}),
    m.Init(protocol_version=99, config={}),
    m.TokenOutputs(step=1, outputs=[m.RequestOutput(request_id="x", new_token_ids=[1])]),
    m.DraftStats(num_seqs=0, num_cache_entries=0, num_requests=0, num_hits=0, num_misses=0),
    m.SpecResponse(step=1, seq_ids=np.zeros(1, np.int64), rounds=np.zeros(1, np.int64),
                   draft_token_ids=np.zeros((1, K), np.int64), num_draft_tokens=np.ones(1, np.int32),
                   cache_hit=np.zeros(1, bool)),
    m.GenerateRequest(request_id="g", prompt_token_ids=np.arange(3), sampling=m.SamplingParams()),
    m.SpecRequest(step=1, seq_ids=np.zeros(1, np.int64), rounds=np.zeros(1, np.int64),
                  num_accepted=np.zeros(1, np.int32), token_ids=np.zeros(1, np.int64),
                  seq_lens=np.ones(1, np.int64), k=K),
]


def fuzz_socket(send_and_check, strategy, accepts: Decoder) -> int:
    """Run >= 1000 hypothesis cases through send_and_check(frames); frames that happen to
    decode as a valid message of this socket are skipped (they are not malformed)."""
    count = [0]

    @FUZZ
    @given(frames=strategy)
    def case(frames):
        try:
            accepts.decode(frames)
            valid = True  # not malformed; out-of-range values are tested separately
        except ProtocolError:
            valid = False
        assume(not valid)
        send_and_check(frames)
        count[0] += 1

    case()
    return count[0]


def _expect_error(chan: Channel, what: str) -> m.ErrorReply:
    reply = chan.recv(timeout_s=10)
    assert isinstance(reply, m.ErrorReply), f"{what}: expected an ErrorReply, got {reply!r}"
    assert reply.code in ("bad_message", "too_large", "version"), reply
    return reply


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    target = save_tiny_model(root / "t", "llama")
    draft = perturbed_copy(target, str(root / "d"), noise=0.2)
    return target, draft


@pytest.fixture(scope="module")
def client(models):
    target, draft = models
    cfg = make_config(target, draft, mode="sd", k=K).replace(sched=SchedulerConfig(max_batch_size=4, max_model_len=128))
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
    valid = [_frames(m.GenerateRequest(request_id="r", prompt_token_ids=np.array(prompt), sampling=sp)),
             _frames(m.AbortRequest(request_id="r")), _frames(m.StatsRequest())]
    with _raw_dealer(client) as raw:
        n = fuzz_socket(lambda f: (raw.socket.send_multipart(f), _expect_error(raw, "client link")),
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
