"""protocol: codec round trips, hostile input, config encoding, and live zmq links."""

from __future__ import annotations

import inspect
import os
import pickle
import shutil
import stat

import msgspec
import numpy as np
import pytest
import zmq
from fuzz_util import STRUCTURED, mangled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import messages as m
from protocol.codec import (
    INLINE_BYTES,
    Decoder,
    ProtocolError,
    check_token_ids,
    check_version,
    decode_config,
    encode,
    encode_config,
)
from protocol.transport import (
    Channel,
    RouterChannel,
    bind,
    curve_keypair,
    ipc_address,
    private_ipc_dir,
    set_curve_client,
    set_curve_server,
    tcp_address,
)
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

UNIONS = [m.HandshakeMessage, m.ClientMessage, m.TargetToClientMessage, m.SpecLinkToDraft, m.SpecLinkToTarget]
DECODERS = {u: Decoder(u) for u in UNIONS}
rng = np.random.default_rng(0)


def _ids(*shape: int) -> np.ndarray:
    return rng.integers(0, 1000, size=shape, dtype=np.int64)


def _sample_messages() -> list[msgspec.Struct]:
    b, k, top = 3, 4, 5
    stats = m.RequestStats(
        num_prompt_tokens=7, num_generated_tokens=9, num_rounds=3, num_draft_tokens=12,
        num_accepted_tokens=6, accepted_per_position=[3, 2, 1, 0], drafted_per_position=[3, 3, 3, 3],
        num_cache_hits=2, num_cache_misses=1, ttft_s=0.25, e2e_s=1.5,
    )
    sampling = m.SamplingParams(max_tokens=32, temperature=0.7, top_k=50, top_p=0.9, seed=5,
                                stop=["\n\n"], stop_token_ids=[2], logprobs=True)
    q_probs = rng.random((b, k, top), dtype=np.float32)
    return [
        m.Hello(protocol_version=m.PROTOCOL_VERSION, role="draft", pid=123),
        m.Init(protocol_version=m.PROTOCOL_VERSION, config=encode_config(RuntimeConfig()),
               spec_addr="ipc:///tmp/x/spec", client_addr="ipc:///tmp/x/client"),
        m.Ready(protocol_version=m.PROTOCOL_VERSION, role="target", pid=9, vocab_size=49152,
                kv_capacity=4096, max_batch_size=8, max_model_len=2048, eos_token_ids=[0, 2],
                graph_batch_sizes=[1, 2, 4], model_name="smol"),
        m.GenerateRequest(request_id="r1", prompt_token_ids=_ids(11), sampling=sampling),
        m.GenerateRequest(request_id="r-empty", prompt_token_ids=_ids(0), sampling=m.SamplingParams()),
        m.AbortRequest(request_id="r1"),
        m.TokenOutputs(step=4, outputs=[
            m.RequestOutput(request_id="r1", new_token_ids=[5, 6], text_delta="hi"),
            m.RequestOutput(request_id="r2", new_token_ids=[], finished=True, finish_reason="stop",
                            logprobs=[-0.5], stats=stats),
        ]),
        m.StatsRequest(),
        m.EngineStats(num_running=2, num_waiting=1, num_free_slots=5, draft_alive=True, mode="ssd",
                      totals=stats, draft_num_seqs=2, draft_num_cache_entries=10),
        m.ErrorReply(code="bad_request", message="no", request_id="r1", seq_id=3),
        m.AddSequence(seq_id=3, prompt_token_ids=_ids(6), temperature=0.5, top_k=10, top_p=0.8, seed=1),
        m.SpecRequest(step=2, seq_ids=_ids(b), rounds=_ids(b), num_accepted=np.array([0, 4, 2], np.int32),
                      token_ids=_ids(b), seq_lens=_ids(b), k=k),
        m.SpecResponse(step=2, seq_ids=_ids(b), rounds=_ids(b), draft_token_ids=_ids(b, k),
                       num_draft_tokens=np.array([4, 4, 0], np.int32), cache_hit=np.array([True, False, True]),
                       q_token_ids=_ids(b, k, top), q_probs=q_probs, draft_work_s=0.01, hits_by_depth=[1, 0, 1]),
        # greedy: sparse q absent (None arrays)
        m.SpecResponse(step=3, seq_ids=_ids(b), rounds=_ids(b), draft_token_ids=_ids(b, k),
                       num_draft_tokens=np.full(b, k, np.int32), cache_hit=np.zeros(b, bool)),
        m.Release(seq_ids=_ids(2)),
        m.DraftStatsRequest(),
        m.DraftStats(num_seqs=1, num_cache_entries=2, num_requests=3, num_hits=4, num_misses=5),
        m.Shutdown(),
    ]


SAMPLES = _sample_messages()


def _union_for(msg) -> object:
    return next(u for u in UNIONS if type(msg) in getattr(u, "__args__", (u,)))


def assert_same(a, b) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b)
        for f in a.__struct_fields__:
            assert_same(getattr(a, f), getattr(b, f))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------- round trips


def test_samples_cover_every_message():
    tagged = {c for _, c in inspect.getmembers(m, inspect.isclass)
              if issubclass(c, msgspec.Struct) and c.__struct_config__.tag is not None}
    assert tagged == {type(s) for s in SAMPLES}
    for u in UNIONS:  # every union decoder builds (msgspec rejects mixed array_like unions)
        Decoder(u)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("inline_bytes", [0, INLINE_BYTES])
def test_round_trip(msg, inline_bytes):
    frames = encode(msg, inline_bytes=inline_bytes)
    arrays = [a for f in msg.__struct_fields__ if isinstance(a := getattr(msg, f), np.ndarray)]
    assert len(frames) == 1 + sum(a.nbytes > inline_bytes for a in arrays)
    # through bytes, as a socket would deliver them
    out = DECODERS[_union_for(msg)].decode([bytes(f) for f in frames])
    assert_same(msg, out)
    for f in out.__struct_fields__:
        v = getattr(out, f)
        if isinstance(v, np.ndarray):
            assert not v.flags.writeable


def test_small_arrays_travel_inline_and_large_ones_in_frames():
    small, large = _ids(8), np.arange(INLINE_BYTES // 8 + 1, dtype=np.int64)
    frames = encode(m.AddSequence(seq_id=1, prompt_token_ids=small))
    assert len(frames) == 1
    frames = encode(m.AddSequence(seq_id=1, prompt_token_ids=large))
    assert len(frames) == 2 and np.shares_memory(np.frombuffer(frames[1], np.int64), large)
    out = DECODERS[m.SpecLinkToDraft].decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(out.prompt_token_ids, large)


def test_encode_is_zero_copy_and_handles_odd_arrays():
    arr = np.arange(12, dtype=np.int64)
    frames = encode(m.Release(seq_ids=arr), inline_bytes=0)
    assert np.shares_memory(np.frombuffer(frames[1], np.int64), arr)
    # non-contiguous and big-endian arrays are normalized (copied) for the wire
    msg = m.Release(seq_ids=np.arange(20, dtype=">i8")[::2])
    out = DECODERS[m.SpecLinkToDraft].decode([bytes(f) for f in encode(msg)])
    np.testing.assert_array_equal(out.seq_ids, np.arange(0, 20, 2))
    with pytest.raises(ProtocolError, match="uint8"):
        encode(m.Release(seq_ids=np.zeros(2, np.uint8)))
    # numpy scalars in int fields encode as ints
    out = DECODERS[m.SpecLinkToDraft].decode(encode(m.AddSequence(seq_id=np.int64(4), prompt_token_ids=_ids(2))))
    assert out.seq_id == 4 and type(out.seq_id) is int


def test_config_round_trip_through_init():
    cfg = RuntimeConfig(
        target=ModelConfig(path="/m/t", device="cuda:0", dtype="bfloat16", gpu_memory_utilization=0.7),
        draft=ModelConfig(path="/m/d.gguf", cuda_graphs=False),
        spec=SpeculativeConfig(mode="ssd", k=3, fan_out=(3, 2, 1, 1), fan_out_miss=(4, 2, 1, 1),
                               draft_temperature=0.5, synthetic_acceptance=(0.6, 0.2, 0.1)),
        sched=SchedulerConfig(max_batch_size=4, max_model_len=512),
        seed=7, log_level="INFO",
    )
    init = m.Init(protocol_version=m.PROTOCOL_VERSION, config=encode_config(cfg))
    out = DECODERS[m.HandshakeMessage].decode([bytes(f) for f in encode(init)])
    check_version(out)
    back = decode_config(out.config)
    assert back == cfg and back.spec.fan_out == (3, 2, 1, 1)


def test_config_rejects_unknown_and_invalid():
    d = encode_config(RuntimeConfig())
    with pytest.raises(ProtocolError, match="bogus"):
        decode_config({**d, "bogus": 1})
    with pytest.raises(ProtocolError, match="config.spec"):
        decode_config({**d, "spec": {**d["spec"], "kk": 4}})
    with pytest.raises(ProtocolError, match="k must be"):
        decode_config({**d, "spec": {**d["spec"], "k": 99}})
    with pytest.raises(ProtocolError):
        decode_config({**d, "seed": "zero"})


def test_version_check():
    check_version(SAMPLES[0])
    other = m.PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match=f"protocol version {other}, expected {m.PROTOCOL_VERSION}") as e:
        check_version(m.Hello(protocol_version=other, role="draft", pid=1))
    assert e.value.code == "version"
    # a future Hello with more fields still reports the version, not a field error
    frame = msgspec.msgpack.encode(["hello", other, "draft", 1, "extra"])
    with pytest.raises(ProtocolError) as e:
        DECODERS[m.HandshakeMessage].decode([frame])
    assert e.value.code == "version"


def test_check_token_ids():
    check_token_ids(np.array([0, 5, 9]), 10, "x")
    check_token_ids(np.array([[0, -1]]), 10, "x", allow_placeholder=True)
    for bad in (np.array([0, 10]), np.array([-1, 2]), np.array([-5])):
        with pytest.raises(ProtocolError, match="outside") as e:
            check_token_ids(bad, 10, "prompt_token_ids")
        assert e.value.code == "bad_request"
    with pytest.raises(ProtocolError):
        check_token_ids(np.array([-2]), 10, "x", allow_placeholder=True)
    with pytest.raises(ProtocolError, match="integer"):
        check_token_ids(np.array([1.0]), 10, "x")


# ---------------------------------------------------------------- hostile input

_REQ = m.SpecRequest(step=1, seq_ids=_ids(2), rounds=_ids(2), num_accepted=np.zeros(2, np.int32),
                     token_ids=_ids(2), seq_lens=_ids(2), k=4)
_REQ_FRAMES = [bytes(f) for f in encode(_REQ, inline_bytes=0)]
_REQ_INLINE = msgspec.msgpack.decode(encode(_REQ)[0])  # the same with its arrays inside


def _with_frame0(obj, arrays=_REQ_FRAMES[1:]):
    return [msgspec.msgpack.encode(obj), *arrays]


_REQ_LIST = msgspec.msgpack.decode(_REQ_FRAMES[0])  # ["req", step, [dtype, shape, idx], ...]

MALFORMED = {
    "random_bytes": [b"\xc1\x00\xff garbage"],
    "empty_frame": [b""],
    "no_frames": [],
    "truncated": [_REQ_FRAMES[0][:-3], *_REQ_FRAMES[1:]],
    "unknown_tag": _with_frame0(["nope", 1]),
    "unknown_field": _with_frame0([*_REQ_LIST, 123]),
    "wrong_field_type": _with_frame0(["req", "one", *_REQ_LIST[2:]]),
    "array_as_list": _with_frame0(["req", 1, [1, 2], *_REQ_LIST[3:]]),
    "missing_array_frame": _REQ_FRAMES[:-1],
    "extra_array_frame": [*_REQ_FRAMES, b"\x00" * 8],
    "frame_index_zero": _with_frame0(["req", 1, ["int64", [2], 0], *_REQ_LIST[3:]]),
    "frame_used_twice": _with_frame0(["req", 1, _REQ_LIST[3], *_REQ_LIST[3:]]),
    "shape_mismatch": _with_frame0(["req", 1, ["int64", [3], 1], *_REQ_LIST[3:]]),
    "short_frame": [_REQ_FRAMES[0], _REQ_FRAMES[1][:-1], *_REQ_FRAMES[2:]],
    "bad_dtype": _with_frame0(["req", 1, ["object", [2], 1], *_REQ_LIST[3:]]),
    "negative_dim": _with_frame0(["req", 1, ["int64", [-2], 1], *_REQ_LIST[3:]]),
    "huge_dims": _with_frame0(["req", 1, ["int64", [0, 2**62, 2**62], 1], *_REQ_LIST[3:]]),
    "wrong_union": [bytes(f) for f in encode(m.Hello(protocol_version=m.PROTOCOL_VERSION, role="x", pid=1))],
    "pickle": [pickle.dumps(_REQ)],
    "pickle_frames": [pickle.dumps(_REQ), *_REQ_FRAMES[1:]],
    "inline_short": _with_frame0(["req", 1, ["int64", [2], b"\x00" * 15], *_REQ_INLINE[3:]], []),
    "inline_as_text": _with_frame0(["req", 1, ["int64", [2], "\x00" * 16], *_REQ_INLINE[3:]], []),
    "inline_and_a_frame": [bytes(f) for f in encode(_REQ)] + [b"\x00" * 8],
}


def test_malformed_sanity():
    assert DECODERS[m.SpecLinkToDraft].decode(_with_frame0(_REQ_LIST)).k == 4  # the base cases are valid
    assert DECODERS[m.SpecLinkToDraft].decode(_with_frame0(_REQ_INLINE, [])).k == 4


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_raises_protocol_error(name):
    with pytest.raises(ProtocolError) as e:
        DECODERS[m.SpecLinkToDraft].decode(MALFORMED[name])
    assert e.value.code in ("bad_message", "too_large") and e.value.message


def test_size_limits():
    small = Decoder(m.SpecLinkToDraft, max_frame_bytes=100)
    small.decode(encode(m.Release(seq_ids=_ids(12)), inline_bytes=0))  # 96 bytes: fits
    with pytest.raises(ProtocolError, match="frame 1 has 104 bytes") as e:
        small.decode(encode(m.Release(seq_ids=_ids(13)), inline_bytes=0))
    assert e.value.code == "too_large"
    with pytest.raises(ProtocolError, match="frames") as e:
        Decoder(m.SpecLinkToDraft, max_frames=3).decode(_REQ_FRAMES)
    assert e.value.code == "too_large"


_valid_frames = st.sampled_from([[bytes(f) for f in encode(s)] for s in SAMPLES])


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    frames=st.one_of(st.lists(st.binary(max_size=64), max_size=5), mangled(_valid_frames), STRUCTURED),
    union=st.sampled_from(UNIONS),
)
def test_fuzz_decoder_raises_only_protocol_error(frames, union):
    try:
        DECODERS[union].decode(frames)
    except ProtocolError:
        pass


# ---------------------------------------------------------------- transport


@pytest.fixture
def ipc_dir():
    d = private_ipc_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_private_ipc_dir_and_address(ipc_dir):
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    assert ipc_address(ipc_dir, "spec") == f"ipc://{ipc_dir}/spec"
    with pytest.raises(ValueError, match="unix sockets"):
        ipc_address(ipc_dir, "x" * 120)
    with pytest.raises(ValueError):
        ipc_address(ipc_dir, "a/b")


def test_bind_refuses_remote_without_flag():
    ctx = zmq.Context()
    try:
        for addr in ("tcp://0.0.0.0:*", "tcp://*:*", tcp_address("0.0.0.0")):
            s = ctx.socket(zmq.PAIR)
            with pytest.raises(ValueError, match="allow_remote"):
                bind(s, addr)
            s.close(0)
        s = ctx.socket(zmq.PAIR)
        ep = bind(s, tcp_address())  # loopback, any port
        assert ep.startswith("tcp://127.0.0.1:") and not ep.endswith(":0")
        s.close(0)
        s = ctx.socket(zmq.PAIR)
        assert bind(s, "tcp://0.0.0.0:*", allow_remote=True).startswith("tcp://0.0.0.0:")
        s.close(0)
    finally:
        ctx.term()


def test_pair_channel_spec_exchange(ipc_dir):
    addr = ipc_address(ipc_dir, "spec")
    with Channel(zmq.PAIR, m.SpecLinkToDraft) as draft, Channel(zmq.PAIR, m.SpecLinkToTarget) as target:
        assert draft.bind(addr) == addr
        target.connect(addr)
        assert draft.recv(timeout_s=0.05) is None  # nothing yet
        target.send(_REQ)
        req = draft.recv(timeout_s=5)
        assert_same(_REQ, req)
        resp = SAMPLES[[type(s) for s in SAMPLES].index(m.SpecResponse)]
        draft.send(resp)
        assert_same(resp, target.recv(timeout_s=5))
        draft.send_error("internal", "boom", seq_id=3)
        err = target.recv(timeout_s=5)
        assert isinstance(err, m.ErrorReply) and err.code == "internal" and err.seq_id == 3


def test_router_survives_garbage_and_oversized(ipc_dir):
    addr = ipc_address(ipc_dir, "client")
    ctx = zmq.Context.instance()
    with RouterChannel(m.ClientMessage, max_frame_bytes=1024) as server, \
            Channel(zmq.DEALER, m.TargetToClientMessage) as good:
        server.bind(addr)
        good.connect(addr)
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(addr)
        try:
            raw.send_multipart([b"\x93garbage", b"xx"])
            with pytest.raises(ProtocolError) as e:
                server.recv(timeout_s=5)
            assert e.value.peer and server.send_error_to(e.value.peer, e.value.code, e.value.message)
            assert raw.poll(5000)
            err = Decoder(m.TargetToClientMessage).decode(raw.recv_multipart())
            assert isinstance(err, m.ErrorReply) and err.code == "bad_message"

            # a frame over MAXMSGSIZE is dropped by libzmq (peer disconnected), never delivered
            raw.send_multipart(encode(m.GenerateRequest(request_id="big", prompt_token_ids=_ids(1000),
                                                        sampling=m.SamplingParams())))
            assert server.recv(timeout_s=0.3) is None

            # the server still serves a well-behaved client
            good.send(m.GenerateRequest(request_id="r1", prompt_token_ids=_ids(4), sampling=m.SamplingParams()))
            ident, req = server.recv(timeout_s=5)
            assert req.request_id == "r1" and ident != e.value.peer
            out = m.TokenOutputs(step=1, outputs=[m.RequestOutput(request_id="r1", new_token_ids=[1])])
            assert server.send_to(ident, out)
            assert good.recv(timeout_s=5).outputs[0].request_id == "r1"
            assert not server.send_to(b"no-such-client", out)
        finally:
            raw.close(0)


def test_curve_rejects_client_without_server_key():
    server_public, server_secret = curve_keypair()
    ctx = zmq.Context.instance()
    with RouterChannel(m.ClientMessage) as server:
        set_curve_server(server.socket, server_secret)
        ep = server.bind(tcp_address())

        def client(server_key: bytes | None) -> Channel:
            c = Channel(zmq.DEALER, m.TargetToClientMessage, ctx=ctx)
            if server_key is not None:
                set_curve_client(c.socket, server_key)
            c.connect(ep)
            return c

        plain, wrong, good = client(None), client(curve_keypair()[0]), client(server_public)
        try:
            plain.send(m.AbortRequest(request_id="plain"))
            wrong.send(m.AbortRequest(request_id="wrong"))
            assert server.recv(timeout_s=0.5) is None  # neither handshake completes
            good.send(m.AbortRequest(request_id="good"))
            ident, msg = server.recv(timeout_s=5)
            assert msg.request_id == "good"
            assert server.send_to(ident, m.ErrorReply(code="x", message="y"))
            assert good.recv(timeout_s=5).message == "y"
            assert server.recv(timeout_s=0.2) is None
        finally:
            for c in (plain, wrong, good):
                c.close()


def test_protocol_imports_no_torch():
    import subprocess
    import sys

    code = "import protocol, sys; assert not [k for k in sys.modules if k.startswith(('torch', 'spec_runtime'))]"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))

