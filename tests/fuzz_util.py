"""Shared by the abuse tests: garbage-frame strategies, a socket fuzzer, and the models.

A fuzzed socket gets frames that are not a message (random bytes, wrong frame counts,
pickles, msgspec values of the wrong shape, valid tags with wild fields) and must answer
each with an ErrorReply or drop it, then still serve a real request.
"""

from __future__ import annotations

import os
import pickle

import msgspec
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from protocol import messages as m
from protocol.codec import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_FRAMES,
    Decoder,
    ProtocolError,
    encode,
)
from protocol.transport import Channel

K = 3
FUZZ = settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
PWNED = "/tmp/spec-runtime-abuse-pwned"


# ---------------------------------------------------------------- garbage frames


def frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


class _Evil:
    """Unpickling this runs a command: proof that no socket ever unpickles."""

    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(sorted(ALLOWED_DTYPES) + ["req", "resp", "init", "gen"]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
TAGS = st.sampled_from(["req", "resp", "add", "rel", "gen", "abort", "out", "init", "hello", "ready", "error",
                        "bye", "stats?", "stats", "dstats", "dstats?", "nope", ""])


def mangled(base):
    """Frames of `base` (a strategy of valid frame lists) with one frame truncated, a
    byte flipped or inserted, or a frame dropped, duplicated or added."""

    @st.composite
    def strategy(draw):
        frames = list(draw(base))
        i = draw(st.integers(0, len(frames) - 1))
        data = bytearray(frames[i])
        op = draw(st.sampled_from(["truncate", "flip", "insert", "drop", "dup", "extra"]))
        if op == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif op == "insert":
            j = draw(st.integers(0, len(data)))
            data[j:j] = draw(st.binary(min_size=1, max_size=8))
        elif op == "drop" and len(frames) > 1:
            return frames[:i] + frames[i + 1:]
        elif op == "dup":
            return frames + [frames[i]]
        elif op == "extra":
            return frames + [draw(st.binary(max_size=16))]
        frames[i] = bytes(data)
        return frames

    return strategy()


# Valid msgpack with a message tag and wild fields, plus stray extra frames.
STRUCTURED = st.builds(lambda tag, rest, extra: [msgspec.msgpack.encode([tag, *rest]), *extra],
                       TAGS, st.lists(MSGPACK_VALUES, max_size=10), st.lists(st.binary(max_size=32), max_size=4))


def garbage(valid: list[list[bytes]]):
    """Frames that must not decode: random bytes, truncated or mangled valid messages,
    unknown tags, valid msgpack in the wrong schema, messages of the other links, pickles,
    too many frames."""
    other_links = st.sampled_from([frames(x) for x in OTHER_LINK_SAMPLES])
    pickles = st.builds(lambda obj, proto: [pickle.dumps(obj, protocol=proto)],
                        MSGPACK_VALUES | st.just(_Evil()) | st.just(m.StatsRequest()), st.integers(0, 5))
    too_many = st.integers(DEFAULT_MAX_FRAMES + 1, DEFAULT_MAX_FRAMES + 8).map(lambda n: [b"\x91\xa6stats?"] * n)
    return st.one_of(st.lists(st.binary(max_size=64), min_size=1, max_size=5), mangled(st.sampled_from(valid)),
                     STRUCTURED, other_links, pickles, too_many)


OTHER_LINK_SAMPLES = [
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


def expect_error(chan: Channel, what: str) -> m.ErrorReply:
    reply = chan.recv(timeout_s=10)
    assert isinstance(reply, m.ErrorReply), f"{what}: expected an ErrorReply, got {reply!r}"
    assert reply.code in ("bad_message", "too_large", "version"), reply
    return reply
