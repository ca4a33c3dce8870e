"""Malformed input on draft_proc's spec PAIR, and out-of-range values inside valid messages.

The real draft (draft_proc.__main__.build over a tiny model, SSD mode) runs its
run_forever loop in a thread of this process, and this test is its peer. Garbage frames
(>= 1000 hypothesis cases) get an ErrorReply; valid message types with wild values (an
unknown seq_id, a negative length, more accepted tokens than proposed, K above the
configured one, token ids out of range) reject only the sequence that carries them; a
real exchange afterwards still works.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import zmq
from e2e_util import make_config, random_prompts
from fuzz_util import PWNED, K, expect_error, frames, fuzz_socket, garbage
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from protocol import messages as m
from protocol.codec import Decoder, encode_config
from protocol.transport import Channel, ipc_address, private_ipc_dir
from spec_runtime.config import SchedulerConfig


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


# ---------------------------------------------------------------- draft's spec PAIR


@pytest.fixture(scope="module")
def draft(models, tmp_path_factory):
    """The real draft (SSD, tiny model) serving a PAIR in this process; the test is its target."""
    from draft_proc.__main__ import build

    target, draft_path = models
    cfg = make_config(target, draft_path, mode="ssd", k=K).replace(
        sched=SchedulerConfig(max_batch_size=8, max_model_len=128, spec_policy="always"))
    ipc_dir = private_ipc_dir()
    addr = ipc_address(ipc_dir, "spec")
    init = m.Init(protocol_version=m.PROTOCOL_VERSION, config=encode_config(cfg), spec_addr=addr)
    ready, run_forever = build(cfg, init)
    worker = run_forever.__self__
    # No pushed stats: a DraftStats on this socket is then always the answer to a
    # DraftStatsRequest, which is how these tests know the draft still serves.
    worker.push_stats = lambda: None
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

    def request(self, outcomes: list[tuple[int, int, int, int]], k: int = K, **flags):
        """outcomes: (seq_id, num_accepted, token_id, seq_len); rounds are tracked here.
        flags: SpecRequest's work_ahead, branches and backup."""
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
            seq_lens=np.array([o[3] for o in outcomes], np.int64), k=k, **flags))

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
    valid = [frames(x) for x in (
        m.AddSequence(seq_id=1, prompt_token_ids=np.arange(4)), m.Release(seq_ids=np.arange(2)), m.DraftStatsRequest(),
        m.SpecRequest(step=1, seq_ids=np.zeros(2, np.int64), rounds=np.ones(2, np.int64),
                      num_accepted=np.zeros(2, np.int32), token_ids=np.ones(2, np.int64),
                      seq_lens=np.full(2, 5, np.int64), k=K))]
    n = fuzz_socket(lambda f: (peer.socket.send_multipart(f), expect_error(peer, "spec link")),
                    garbage(valid), Decoder(m.SpecLinkToDraft))
    assert n >= 1000 and thread.is_alive()
    _real_exchange(peer, 1, vocab)
    assert thread.is_alive() and not worker.seqs and not os.path.exists(PWNED)


def test_a_plain_steps_outcomes_are_taken_in_without_an_answer(draft):
    peer, worker, thread, vocab = draft
    r = _Rounds(peer)
    r.add(20, [5, 9, 14, 3])
    r.request([(20, 0, 7, 5)])
    (resp,) = r.replies_until_stats()
    assert int(resp.num_draft_tokens[0]) == K
    r.request([(20, 0, 8, 6)], work_ahead=False, backup="none")  # plain: the draft's K tokens were not verified
    assert r.replies_until_stats() == []
    r.request([(20, 0, 9, 7)], work_ahead=False, backup="none")
    assert r.replies_until_stats() == []
    # Two plain steps held by the target go out in one request, the sequence's rows in order.
    r.request([(20, 0, 10, 8), (20, 0, 11, 9)], work_ahead=False, backup="none")
    assert r.replies_until_stats() == []
    assert worker.seqs[20].token_ids == [5, 9, 14, 3, 7, 8, 9, 10, 11]
    # A request to answer must name each sequence once: rejected whole, nothing applied.
    r.request([(20, 0, 12, 10), (20, 0, 13, 11)], work_ahead=False)
    (err,) = r.replies_until_stats()
    assert isinstance(err, m.ErrorReply) and err.code == "bad_request" and "each sequence once" in err.message
    assert worker.seqs[20].token_ids == [5, 9, 14, 3, 7, 8, 9, 10, 11]
    r.state[20]["round"] -= 2  # the rejected request's rounds were never taken
    r.request([(20, 0, 12, 10)], work_ahead=False)  # an SD round: answered with a chain
    (resp,) = r.replies_until_stats()
    assert resp.seq_ids.tolist() == [20] and resp.rounds.tolist() == [6] and int(resp.num_draft_tokens[0]) == K
    peer.send(m.Release(seq_ids=np.array([20], np.int64)))
    assert r.replies_until_stats() == [] and thread.is_alive()


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


