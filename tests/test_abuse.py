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
from hypothesis import HealthCheck, Phase, assume, given, settings
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


# ---------------------------------------------------------------- draft's spec PAIR


@pytest.fixture(scope="module")
def draft(models, tmp_path_factory):
    """The real draft (SSD, tiny model) serving a PAIR in this process; the test is its target."""
    from draft_proc.__main__ import build

    target, draft_path = models
    cfg = make_config(target, draft_path, mode="ssd", k=K).replace(
        sched=SchedulerConfig(max_batch_size=8, max_model_len=128))
    ipc_dir = private_ipc_dir()
    addr = ipc_address(ipc_dir, "spec")
    init = m.Init(protocol_version=m.PROTOCOL_VERSION, config=encode_config(cfg), spec_addr=addr)
    ready, run_forever = build(cfg, init)
    worker = run_forever.__self__
    thread = threading.Thread(target=run_forever, name="draft-under-test", daemon=True)
    thread.start()
    peer = Channel(zmq.PAIR, m.SpecLinkToTarget)
    peer.connect(addr)
    yield peer, worker, thread, ready.vocab_size
    worker.running = False
    thread.join(5)
    peer.close()
    worker.channel.close()


class _Rounds:
    """Drives sequences through the draft the way target_proc does (greedy outcomes)."""

    def __init__(self, peer):
        self.peer = peer
        self.step = 0
        self.state: dict[int, dict] = {}

    def add(self, sid: int, prompt: list[int]) -> None:
        self.peer.send(m.AddSequence(seq_id=sid, prompt_token_ids=np.array(prompt, np.int64)))
        # First outcome after (re-)adding: (0, the token after the prompt).
        self.state[sid] = {"len": len(prompt), "round": 0, "proposed": 0}

    def request(self, outcomes: list[tuple[int, int, int, int]], k: int = K):
        """outcomes: (seq_id, num_accepted, token_id, seq_len); rounds are tracked here."""
        self.step += 1
        rounds = []
        for sid, *_ in outcomes:
            st_ = self.state.setdefault(sid, {"len": 0, "round": 0, "proposed": 0})
            st_["round"] += 1
            rounds.append(st_["round"])
        self.peer.send(m.SpecRequest(
            step=self.step, seq_ids=np.array([o[0] for o in outcomes], np.int64), rounds=np.array(rounds, np.int64),
            num_accepted=np.array([o[1] for o in outcomes], np.int32),
            token_ids=np.array([o[2] for o in outcomes], np.int64),
            seq_lens=np.array([o[3] for o in outcomes], np.int64), k=k))

    def replies_until_stats(self) -> list:
        """Everything the draft sent before answering a DraftStatsRequest (which proves it
        still serves)."""
        self.peer.send(m.DraftStatsRequest())
        got = []
        while True:
            msg = self.peer.recv(timeout_s=30)
            assert msg is not None, f"the draft stopped answering after {got}"
            if isinstance(msg, m.DraftStats):
                return got
            got.append(msg)


def _real_exchange(peer, sid: int, vocab: int) -> None:
    r = _Rounds(peer)
    r.add(sid, [5, 9, 14, 3])
    r.request([(sid, 0, 7, 5)])
    (resp,) = r.replies_until_stats()
    assert isinstance(resp, m.SpecResponse) and resp.seq_ids.tolist() == [sid]
    assert int(resp.num_draft_tokens[0]) == K and 0 <= resp.draft_token_ids.min() and resp.draft_token_ids.max() < vocab
    peer.send(m.Release(seq_ids=np.array([sid], np.int64)))
    assert r.replies_until_stats() == []


def test_fuzz_draft_spec_socket(draft):
    peer, worker, thread, vocab = draft
    valid = [_frames(x) for x in (
        m.AddSequence(seq_id=1, prompt_token_ids=np.arange(4)), m.Release(seq_ids=np.arange(2)), m.DraftStatsRequest(),
        m.SpecRequest(step=1, seq_ids=np.zeros(2, np.int64), rounds=np.ones(2, np.int64),
                      num_accepted=np.zeros(2, np.int32), token_ids=np.ones(2, np.int64),
                      seq_lens=np.full(2, 5, np.int64), k=K))]
    n = fuzz_socket(lambda f: (peer.socket.send_multipart(f), _expect_error(peer, "spec link")),
                    garbage(valid), Decoder(m.SpecLinkToDraft))
    assert n >= 1000 and thread.is_alive()
    _real_exchange(peer, 1, vocab)
    assert thread.is_alive() and not worker.seqs and not os.path.exists(PWNED)


def test_draft_rejects_out_of_range_outcomes_alone(draft):
    peer, worker, thread, vocab = draft
    r = _Rounds(peer)
    prompts = {sid: random_prompts(vocab, lengths=(6,), seed=sid)[0] for sid in range(10, 15)}
    for sid, p in prompts.items():
        r.add(sid, p)
    r.request([(sid, 0, 7, len(p) + 1) for sid, p in prompts.items()])
    (resp,) = r.replies_until_stats()
    assert resp.seq_ids.tolist() == list(prompts) and (resp.num_draft_tokens == K).all()
    n = {sid: len(p) + 1 for sid, p in prompts.items()}
    # K above the configured K: that SpecRequest is rejected as a whole; state is untouched.
    r.request([(10, 1, 7, n[10] + 2)], k=K + 1)
    (err,) = r.replies_until_stats()
    assert isinstance(err, m.ErrorReply) and err.code == "bad_request" and f"k <= {K}" in err.message
    r.request([
        (10, 1, 7, n[10] + 2),           # fine
        (11, K + 1, 7, n[11] + K + 2),   # more accepted than proposed
        (12, 0, 7, -4),                  # a negative length
        (13, 0, vocab, n[13] + 1),       # a token id >= vocab
        (99, 0, 7, 9),                   # an unknown seq_id
        (14, K, 8, n[14] + K + 1),       # fine: all accepted, bonus token
    ])
    replies = r.replies_until_stats()
    errors = {e.seq_id: e for e in replies if isinstance(e, m.ErrorReply)}
    (resp,) = [x for x in replies if isinstance(x, m.SpecResponse)]
    assert set(errors) == {11, 12, 13, 99} and all(e.code == "desync" for e in errors.values())
    assert resp.seq_ids.tolist() == [10, 14] and (resp.num_draft_tokens == K).all()
    # A prompt with an id out of range is refused at AddSequence.
    peer.send(m.AddSequence(seq_id=20, prompt_token_ids=np.array([1, vocab + 5])))
    (err,) = r.replies_until_stats()
    assert err.code == "bad_request" and err.seq_id == 20
    peer.send(m.Release(seq_ids=np.arange(10, 15)))
    assert r.replies_until_stats() == [] and not worker.seqs and thread.is_alive()


_ints = st.integers(-3, 140) | st.sampled_from([-(2**63), 2**63 - 1, 2**31])
_arr = st.lists(_ints, max_size=5)


@st.composite
def _valid_typed(draw, vocab: int):
    """Messages of the right type with arbitrary values inside them."""
    kind = draw(st.sampled_from(["add", "req", "rel"]))
    sid = st.integers(-2, 6) | st.sampled_from([2**63 - 1, -(2**63)])
    if kind == "add":
        prompt = draw(st.lists(st.integers(-2, vocab + 2), max_size=140))
        dims = draw(st.sampled_from([(len(prompt),), (1, len(prompt))]))
        return m.AddSequence(seq_id=draw(sid), prompt_token_ids=np.array(prompt, np.int64).reshape(dims),
                             temperature=draw(st.floats(allow_nan=True) | st.just(0.0)),
                             top_k=draw(st.integers(-1, 2**63 - 1) | st.just(0)),
                             top_p=draw(st.floats(-1, 2) | st.just(float("nan")) | st.just(1.0)),
                             seed=draw(st.integers(-(2**63), 2**64 - 1)))
    if kind == "rel":
        ids = draw(_arr)
        return m.Release(seq_ids=np.array(ids, np.int64).reshape(draw(st.sampled_from([(len(ids),), (1, len(ids))]))))
    b = draw(st.integers(0, 4))
    cols = [np.array(draw(st.lists(_ints, min_size=b, max_size=b)), np.int64) for _ in range(5)]
    bad = draw(st.sampled_from(["none", "none", "shape", "float"]))  # sometimes one wrong array
    if bad == "shape":
        cols[draw(st.integers(0, 4))] = np.array(draw(_arr), np.int64).reshape(-1, 1)
    elif bad == "float":
        cols[draw(st.integers(0, 4))] = np.full(b, float("nan"), np.float32)
    acc = cols[2] if cols[2].dtype.kind == "f" else cols[2].astype(np.int32)
    return m.SpecRequest(step=1, seq_ids=cols[0], rounds=cols[1], num_accepted=acc,
                         token_ids=cols[3], seq_lens=cols[4], k=draw(st.integers(-1, K + 2)))


def test_fuzz_draft_valid_types_wild_values(draft):
    """Right message types, wrong values: the draft answers (errors or speculations) and
    keeps serving; nothing it holds leaks past a Release of every id it could hold."""
    peer, worker, thread, vocab = draft

    # No shrinking: after a crash of the draft's loop every later example would hang.
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    @given(msgs=st.lists(_valid_typed(vocab), min_size=1, max_size=4))
    def case(msgs):
        assert thread.is_alive(), "the draft's loop died in an earlier example"
        for msg in msgs:
            peer.send(msg)
        replies = _Rounds(peer).replies_until_stats()
        assert thread.is_alive()
        assert all(isinstance(x, (m.ErrorReply, m.SpecResponse)) for x in replies), replies

    case()
    peer.send(m.Release(seq_ids=np.array(sorted(worker.seqs), np.int64)))
    assert _Rounds(peer).replies_until_stats() == [] and not worker.seqs
    _real_exchange(peer, 3, vocab)


WILD_ADDS = {
    "prompt-at-limit": dict(prompt_token_ids=np.full(127, 5)),
    "prompt-past-limit": dict(prompt_token_ids=np.full(131, 5)),
    "temperature-nan": dict(prompt_token_ids=np.arange(3, 9), temperature=float("nan")),
    "temperature-inf": dict(prompt_token_ids=np.arange(3, 9), temperature=float("inf")),
    "temperature-huge": dict(prompt_token_ids=np.arange(3, 9), temperature=1e308),
    "top-k-huge": dict(prompt_token_ids=np.arange(3, 9), temperature=1.0, top_k=2**63 - 1),
    "top-p-tiny": dict(prompt_token_ids=np.arange(3, 9), temperature=1.0, top_p=1e-30),
    "seed-huge": dict(prompt_token_ids=np.arange(3, 9), temperature=1.0, seed=2**64 - 1),
    "seed-negative": dict(prompt_token_ids=np.arange(3, 9), temperature=1.0, seed=-(2**63)),
}


@pytest.mark.parametrize("name", list(WILD_ADDS))
def test_draft_wild_sequence_is_contained(draft, name):
    """A sequence with extreme values, driven through a consistent outcome: the draft
    answers it (speculation or error) and keeps serving the others."""
    peer, worker, thread, vocab = draft
    assert thread.is_alive(), "the draft's loop died in an earlier test"
    add = m.AddSequence(seq_id=40, **WILD_ADDS[name])
    peer.send(add)
    r = _Rounds(peer)
    r.request([(40, 0, 7, len(add.prompt_token_ids) + 1)])
    replies = r.replies_until_stats()
    assert thread.is_alive(), f"{name} killed the draft's loop"
    # Either a speculation, or errors naming the sequence (refused at AddSequence, then unknown).
    resp = [x for x in replies if isinstance(x, m.SpecResponse)]
    errors = [x for x in replies if isinstance(x, m.ErrorReply) and x.seq_id == 40]
    assert len(resp) + len(errors) == len(replies) and (len(resp) == 1) != bool(errors), replies
    if resp:
        ids = resp[0].draft_token_ids
        assert ((ids >= 0) & (ids < vocab) | (ids == -1)).all()
    peer.send(m.Release(seq_ids=np.array([40], np.int64)))
    _real_exchange(peer, 41, vocab)


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
    valid = [_frames(x) for x in _OTHER_LINK_SAMPLES if isinstance(x, (m.SpecResponse, m.DraftStats))]

    def check(frames):
        r = next(rounds)
        fake_draft.socket.send_multipart(frames)
        fake_draft.send(m.SpecResponse(step=r, seq_ids=np.array([7]), rounds=np.array([r]),
                                       draft_token_ids=np.array([[4, 5, 6]]), num_draft_tokens=np.array([3], np.int32),
                                       cache_hit=np.array([True])))
        got = link.collect({7: r})
        assert list(got) == [7] and got[7].draft_token_ids.tolist() == [4, 5, 6] and link.alive

    try:
        assert fuzz_socket(check, garbage(valid), Decoder(m.SpecLinkToTarget)) >= 1000
        assert not link.desynced and link.num_timeouts == 0
    finally:
        link.channel.close()
        fake_draft.close()
