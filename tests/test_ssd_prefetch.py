"""SSD prefetch: the draft works ahead for a sequence as soon as it is added, so the
first outcome (0, t) of that sequence can hit the tree cache.

The worker is driven message by message (an in-memory channel, `run_once`) with a tiny
random draft. Every speculation the worker returns, hit or miss, is compared with what a
separate chain drafter, on its own fresh KV, drafts from scratch after the same outcome:
that checks the prefetched branches and the num_cached bookkeeping after a prefetch.
Then the real draft loop over ZeroMQ, and one end-to-end greedy run against AR.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import pytest
import zmq
from conftest import save_tiny_model
from e2e_util import make_config, random_prompts, wait_until

from draft_proc.drafter import ModelDrafter
from draft_proc.factory import make_speculators
from draft_proc.state import DraftSeq
from draft_proc.worker import DraftWorker
from protocol import messages as m
from protocol.codec import encode_config
from protocol.transport import Channel, ipc_address, private_ipc_dir
from spec_runtime.client import Client
from spec_runtime.engine.runner import ModelRunner

K = 3
PROMPTS = {1: [5, 9, 14, 3, 77, 120, 8], 2: [40, 41, 200, 13, 6, 90, 91, 92, 17, 300, 4]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("prefetch") / "m", "llama")


class MemoryChannel:
    """The draft's end of the spec link, in memory: queued messages in, replies out."""

    def __init__(self):
        self.inbox: deque = deque()
        self.sent: list = []
        self.pushed: list = []
        self.timeouts: list[float] = []
        self.always_pending = False  # pretend the next request is waiting after each work-ahead

    def recv(self, timeout_s=None):
        self.timeouts.append(timeout_s)
        return self.inbox.popleft() if self.inbox else None

    def send(self, msg) -> None:
        self.sent.append(msg)

    def try_send(self, msg) -> bool:
        self.pushed.append(msg)  # the draft's own counter pushes, kept apart from its replies
        return True

    def pending(self) -> bool:
        return self.always_pending or bool(self.inbox)

    def send_error(self, code: str, message: str, request_id: str = "", seq_id: int = -1) -> None:
        self.sent.append(m.ErrorReply(code=code, message=message, request_id=request_id, seq_id=seq_id))


class Harness:
    """A DraftWorker as draft_proc builds it, a reference chain drafter, and the target's
    side of the bookkeeping (tokens, rounds, the speculation last returned)."""

    def __init__(self, model_dir, mode="ssd", temperature=0.0, **spec):
        self.cfg = make_config(model_dir, model_dir, mode=mode, k=K, **spec)
        speculator, ssd, vocab, info = make_speculators(self.cfg)
        self.chan = MemoryChannel()
        self.worker = DraftWorker(self.cfg, self.chan, speculator, vocab, num_slots=4, ssd=ssd, kv=info["kv"])
        self.prefetched: list[list[int]] = []
        if ssd is not None:  # record each prefetch batch, then run it
            real = ssd.prefetch

            def recording(seqs):
                self.prefetched.append([s.seq_id for s in seqs])
                real(seqs)

            ssd.prefetch = recording
        runner = ModelRunner(self.cfg.draft, num_slots=1, max_model_len=self.cfg.sched.max_model_len)
        self.reference = ModelDrafter(runner, self.cfg.spec)
        self.temperature = temperature
        self.tokens: dict[int, list[int]] = {}
        self.rounds: dict[int, int] = {}
        self.last: dict[int, list[int]] = {}  # the speculation last returned, per sequence
        self.step = 0

    def add(self, sid: int) -> None:
        self.chan.inbox.append(m.AddSequence(seq_id=sid, prompt_token_ids=np.array(PROMPTS[sid], np.int64),
                                             temperature=self.temperature, seed=100 + sid))
        self.tokens[sid] = list(PROMPTS[sid])

    def chain(self, sid: int, tokens: list[int]):
        """What the chain drafter drafts after `tokens` -> (draft ids [K], q ids, q probs)."""
        (prop,) = self.reference.propose([DraftSeq(sid, 0, list(tokens), self.temperature, seed=100 + sid)], K)
        return prop.draft_token_ids.tolist(), prop.q_token_ids, prop.q_probs

    def request(self, outcomes: list[tuple[int, int, int]], **flags) -> None:
        """outcomes: (seq_id, num_accepted, token_id) of the speculation last returned;
        flags: SpecRequest's work_ahead, branches, backup."""
        self.step += 1
        lens = []
        for sid, j, t in outcomes:
            self.tokens[sid] += self.last.get(sid, [])[:j] + [t]
            self.rounds[sid] = self.rounds.get(sid, 0) + 1
            lens.append(len(self.tokens[sid]))
        self.chan.inbox.append(m.SpecRequest(
            step=self.step, seq_ids=np.array([o[0] for o in outcomes], np.int64),
            rounds=np.array([self.rounds[o[0]] for o in outcomes], np.int64),
            num_accepted=np.array([o[1] for o in outcomes], np.int32),
            token_ids=np.array([o[2] for o in outcomes], np.int64), seq_lens=np.array(lens, np.int64), k=K, **flags))

    def drain(self) -> None:
        """Handle every queued message (no idle poll in between)."""
        while self.chan.inbox:
            self.worker.run_once()

    def response(self) -> m.SpecResponse:
        (resp,) = [x for x in self.chan.sent if isinstance(x, m.SpecResponse)]
        assert not [x for x in self.chan.sent if isinstance(x, m.ErrorReply)], self.chan.sent
        self.chan.sent.clear()
        for b, sid in enumerate(resp.seq_ids.tolist()):
            self.last[sid] = resp.draft_token_ids[b, : resp.num_draft_tokens[b]].tolist()
        return resp

    def check_exact(self, resp: m.SpecResponse) -> None:
        """Each returned speculation is what the chain drafter drafts from scratch."""
        for b, sid in enumerate(resp.seq_ids.tolist()):
            want, qi, qp = self.chain(sid, self.tokens[sid])
            assert resp.draft_token_ids[b].tolist() == want, (sid, bool(resp.cache_hit[b]))
            if self.temperature > 0:
                np.testing.assert_array_equal(resp.q_token_ids[b], qi)
                np.testing.assert_allclose(resp.q_probs[b], qp, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_first_request_after_add_hits_and_is_exact(model_dir, temperature):
    h = Harness(model_dir, temperature=temperature)
    ssd = h.worker.ssd
    h.add(1)
    h.add(2)
    h.drain()
    assert not h.prefetched and list(h.worker.fresh) == [1, 2]
    h.worker.run_once()  # nothing waiting: one work-ahead over both new sequences
    assert h.prefetched == [[1, 2]] and not h.worker.fresh and h.chan.timeouts[-1] == 0.0
    assert not h.chan.sent  # a prefetch answers nothing
    budget = ssd.cache.max_branches  # m = 0: the whole per-sequence budget forks depth 0
    for sid in (1, 2):
        assert len(ssd.cache.entries(sid)) == budget and {j for j, _ in ssd.cache.entries(sid)} == {0}
    h.worker.run_once()
    assert h.prefetched == [[1, 2]] and h.chan.timeouts[-1] == 0.5  # nothing fresh: wait as before

    # The target's first tokens: greedy, the draft's own top token; sampled, a forked one.
    if temperature == 0:
        firsts = {sid: h.chain(sid, PROMPTS[sid])[0][0] for sid in (1, 2)}
    else:
        firsts = {sid: min(t for _, t in ssd.cache.entries(sid)) for sid in (1, 2)}
    h.request([(sid, 0, t) for sid, t in firsts.items()])
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [True, True] and resp.hits_by_depth[0] == 2
    assert temperature > 0 or resp.hit_rank.tolist() == [0, 0]  # the draft's top token: its likeliest fork
    assert (resp.num_draft_tokens == K).all() and ssd.num_hits == 2 and ssd.num_misses == 0
    h.check_exact(resp)

    # The next round, from the state the hit left: 1 rejects at depth 1 with a token the
    # draft may not have forked, 2 accepts everything. Hit or miss, still exact.
    reject = next(t for t in range(3, 384) if t != h.last[1][1] and ssd.cache.lookup(1, 1, t) is None)
    bonus = next(t for j, t in ssd.cache.entries(2) if j == K)  # greedy: the draft's top token
    h.request([(1, 1, reject), (2, K, bonus)])
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [False, True] and resp.hit_rank[0] == -1 and resp.hit_rank[1] >= 0
    h.check_exact(resp)
    assert h.prefetched == [[1, 2]]


def test_request_before_idle_poll_takes_the_miss_path(model_dir):
    h = Harness(model_dir)
    h.add(1)
    h.add(2)
    first = {sid: h.chain(sid, PROMPTS[sid])[0][0] for sid in (1, 2)}
    h.request([(1, 0, first[1])])  # arrives before any idle moment
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [False] and not h.prefetched
    h.check_exact(resp)
    assert list(h.worker.fresh) == [2]
    # Added, then released before the loop was idle: never prefetched either.
    h.chan.inbox.extend([m.AddSequence(seq_id=3, prompt_token_ids=np.arange(3, 12)),
                         m.Release(seq_ids=np.array([3], np.int64))])
    h.drain()
    h.worker.run_once()
    assert h.prefetched == [[2]]  # 1 had moved on, 3 is gone
    h.request([(1, 0, next(t for t in range(3, 384) if t != h.last[1][0])), (2, 0, first[2])])
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist()[1] is True
    h.check_exact(resp)
    h.worker.run_once()
    assert h.prefetched == [[2]]


def test_failed_prefetch_is_logged_and_the_sequence_misses_exactly(model_dir, caplog):
    h = Harness(model_dir)
    ssd = h.worker.ssd

    def broken(*args):
        raise RuntimeError("tree decode broke")

    ssd._tree_decode = broken  # fails after the glue has written the prompt's KV
    h.add(1)
    h.drain()
    h.worker.run_once()
    assert "prefetch for 1 new sequences failed" in caplog.text and "tree decode broke" in caplog.text
    assert ssd.num_entries() == 0 and h.worker.seqs[1].num_cached == 0 and not h.worker.fresh
    del ssd._tree_decode
    h.request([(1, 0, h.chain(1, PROMPTS[1])[0][0])])
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [False]
    h.check_exact(resp)


def test_sd_mode_never_prefetches(model_dir):
    h = Harness(model_dir, mode="sd")
    h.add(1)
    h.drain()
    h.worker.run_once()
    assert not h.worker.fresh and h.chan.timeouts == [0.5, 0.5] and not h.chan.sent
    h.request([(1, 0, h.chain(1, PROMPTS[1])[0][0])])
    h.drain()
    resp = h.response()
    assert not resp.cache_hit.any()
    h.check_exact(resp)


def test_real_draft_loop_prefetches_over_zmq(model_dir):
    """The draft as draft_proc builds it, in a thread behind its PAIR socket: after an
    AddSequence the cache fills with no request, and the first outcome hits."""
    from draft_proc.__main__ import build

    cfg = make_config(model_dir, model_dir, mode="ssd", k=K)
    addr = ipc_address(private_ipc_dir(), "spec")
    _, run_forever = build(cfg, m.Init(protocol_version=m.PROTOCOL_VERSION, config=encode_config(cfg),
                                       spec_addr=addr))
    worker = run_forever.__self__
    thread = threading.Thread(target=run_forever, daemon=True)
    thread.start()
    peer = Channel(zmq.PAIR, m.SpecLinkToTarget)
    peer.connect(addr)
    try:
        peer.send(m.AddSequence(seq_id=5, prompt_token_ids=np.array(PROMPTS[1], np.int64)))

        def entries():
            peer.send(m.DraftStatsRequest())
            return peer.recv(timeout_s=10).num_cache_entries

        assert wait_until(lambda: entries() > 0, timeout_s=20)
        # The first token of a greedy target equal to the draft: the draft's top token.
        ref = ModelDrafter(ModelRunner(cfg.draft, num_slots=1, max_model_len=cfg.sched.max_model_len), cfg.spec)
        t = int(ref.propose([DraftSeq(0, 0, list(PROMPTS[1]))], K)[0].draft_token_ids[0])
        peer.send(m.SpecRequest(step=1, seq_ids=np.array([5]), rounds=np.array([1]),
                                num_accepted=np.array([0], np.int32), token_ids=np.array([t]),
                                seq_lens=np.array([len(PROMPTS[1]) + 1]), k=K))
        resp = peer.recv(timeout_s=20)
        assert isinstance(resp, m.SpecResponse) and resp.cache_hit.tolist() == [True]
        want = ref.propose([DraftSeq(0, 0, PROMPTS[1] + [t])], K)[0].draft_token_ids.tolist()
        assert resp.draft_token_ids[0].tolist() == want
    finally:
        worker.running = False
        thread.join(5)
        peer.close()
        worker.channel.close()


def test_ssd_greedy_equals_ar_end_to_end(model_dir, ar_reference):
    prompts = random_prompts(384, lengths=(6, 13, 21))
    greedy = m.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ar = ar_reference(model_dir, prompts, greedy.max_tokens)
    with Client(make_config(model_dir, model_dir, mode="ssd", k=K)) as client:
        ssd = client.generate_batch(prompts, greedy)
    assert [r.token_ids for r in ssd] == ar
    # Draft == target: every later outcome is a forked bonus token; only the first
    # look-up can miss, and it hits when the prefetch ran before the first request.
    assert all(r.stats.num_cache_misses <= 1 for r in ssd), [r.stats for r in ssd]


def test_tree_shrinks_when_the_next_request_is_already_waiting_and_stays_exact(model_dir):
    h = Harness(model_dir, tree_shape="auto")
    ssd = h.worker.ssd
    h.add(1)
    h.drain()
    h.worker.run_once()  # prefetch
    top = ssd.budget.branches(1)
    assert top > 1
    h.chan.always_pending = True  # every work-ahead ends with the request queued: an overrun
    t = h.chain(1, PROMPTS[1])[0][0]
    h.request([(1, 0, t)])
    for _ in range(3):
        h.drain()
        resp = h.response()
        h.check_exact(resp)
        bonus = h.chain(1, h.tokens[1] + h.last[1])[0][0]  # target = draft: greedy accepts all
        h.request([(1, K, bonus)])
    h.drain()
    h.check_exact(h.response())
    assert ssd.budget.branches(1) < top and ssd.budget.num_shrinks >= 1
    assert h.worker.stats().num_tree_shrinks == ssd.budget.num_shrinks


def test_fixed_tree_keeps_its_shape_when_the_request_is_waiting(model_dir):
    h = Harness(model_dir, tree_shape="fixed")
    h.add(1)
    h.drain()
    h.worker.run_once()
    top = h.worker.ssd.budget.branches(1)
    h.chan.always_pending = True
    h.request([(1, 0, h.chain(1, PROMPTS[1])[0][0])])
    for _ in range(3):
        h.drain()
        h.check_exact(h.response())
        h.request([(1, K, h.chain(1, h.tokens[1] + h.last[1])[0][0])])
    h.drain()
    h.check_exact(h.response())
    assert h.worker.ssd.budget.branches(1) == top and h.worker.stats().num_tree_shrinks == 0


def test_a_request_names_the_tree_shape_and_the_backup_and_stays_exact(model_dir):
    """The target's round policy names the branches per sequence and the backup per
    request: the draft follows (counting each move) and every answer stays exact."""
    h = Harness(model_dir, tree_shape="auto")
    ssd = h.worker.ssd
    levels = h.cfg.spec.tree_levels(1)
    assert len(levels) == 3 and ssd.budget.policy == "auto"
    h.add(1)
    h.drain()
    h.worker.run_once()  # prefetch, at the largest tree
    h.request([(1, 0, h.chain(1, PROMPTS[1])[0][0])], branches=levels[1])
    h.drain()
    h.check_exact(h.response())
    assert ssd.budget.branches(1) == levels[1] and ssd.budget.num_shrinks == 1
    assert len(ssd.cache.entries(1)) <= levels[1]
    # A miss answered with no backup: no drafts, and the next round (from an empty
    # speculation) is exact again; a request for more branches than exist gets the largest tree.
    reject = next(t for t in range(3, 384) if t != h.last[1][1] and ssd.cache.lookup(1, 1, t) is None)
    h.request([(1, 1, reject)], branches=100, backup="none")
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [False] and resp.num_draft_tokens.tolist() == [0]
    assert ssd.budget.branches(1) == levels[0] and ssd.budget.num_grows == 1
    h.request([(1, 0, h.chain(1, h.tokens[1])[0][0])], branches=levels[2])
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [True]
    h.check_exact(resp)
    assert h.worker.stats().num_tree_shrinks == 2 and h.worker.stats().num_tree_grows == 1
    h.request([(1, 0, 5)], backup="ngram")  # not a backup a request can name
    h.drain()
    (err,) = h.chan.sent
    assert isinstance(err, m.ErrorReply) and err.code == "bad_request" and "backup" in err.message


def test_a_short_jit_backup_drafts_fewer_tokens_for_a_miss(model_dir):
    """backup "jit:N" answers a miss with the first N tokens of the chain the jit backup
    drafts; N outside [1, K] is refused."""
    h = Harness(model_dir, tree_shape="auto")
    h.add(1)
    h.drain()
    h.worker.run_once()  # prefetch
    h.request([(1, 0, h.chain(1, PROMPTS[1])[0][0])])
    h.drain()
    h.check_exact(h.response())
    reject = next(t for t in range(3, 384) if t != h.last[1][1] and h.worker.ssd.cache.lookup(1, 1, t) is None)
    h.request([(1, 1, reject)], backup="jit:2")
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [False] and resp.num_draft_tokens.tolist() == [2]
    assert resp.draft_token_ids[0, :2].tolist() == h.chain(1, h.tokens[1])[0][:2]
    # The next round follows the 2-token speculation: a hit at depth 2 stays exact.
    h.request([(1, 2, h.chain(1, h.tokens[1])[0][2])])
    h.drain()
    resp = h.response()
    assert resp.cache_hit.tolist() == [True]
    h.check_exact(resp)
    for bad in ("jit:0", f"jit:{K + 1}", "jit:x"):
        h.request([(1, 0, 5)], backup=bad)
        h.drain()
        (err,) = h.chan.sent
        h.chan.sent.clear()
        assert isinstance(err, m.ErrorReply) and err.code == "bad_request" and "backup" in err.message
