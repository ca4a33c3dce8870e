"""DraftLink: the target's end of the spec link, against this test as the draft.

  - the link owns every sequence's sync state: add, first outcome, speculation, and a
    re-add of every sequence after the draft comes back; a plain step's outcomes ask for
    no answer, and the step after waits for none;
  - answers taken between collects (with the pushed counters) wait for the next collect;
    stale ones are dropped, and one that answers a sequence not awaited now (the other
    half of the batch in halves steps) waits for that sequence's collect;
  - the draft's counters are the ones it pushed last: a stats request is answered at
    once, without a message to the draft, even while the draft does not read (stalled).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq

from e2e_util import wait_until
from protocol import messages as m
from protocol.transport import Channel, ipc_address, private_ipc_dir
from spec_runtime.config import RuntimeConfig, SchedulerConfig, SpeculativeConfig
from target_proc.draft_link import DraftLink
from target_proc.round_model import PLAIN, SD
from target_proc.sequence import Sequence
from target_proc.worker import TargetWorker

K = 3


@pytest.fixture
def pair():
    """(link, fake draft channel): a connected spec link whose draft end is this test."""
    ipc_dir = private_ipc_dir()
    addr = ipc_address(ipc_dir, "spec")
    draft = Channel(zmq.PAIR, m.SpecLinkToDraft)
    draft.bind(addr)
    link = DraftLink(Channel(zmq.PAIR, m.SpecLinkToTarget), addr, timeout_s=5.0, k=K, vocab_size=100)
    link.wait_connected(5.0)
    yield link, draft
    link.channel.close()
    draft.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _seq(seq_id: int, tokens: list[int], max_tokens: int = 50) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), client=b"c", prompt_token_ids=tokens,
                    sampling=m.SamplingParams(max_tokens=max_tokens), seed=seq_id)


def _take(draft: Channel) -> list:
    """Every message the draft end has received so far (waits for the first)."""
    got = [draft.recv(timeout_s=5.0)]
    while (msg := draft.recv(timeout_s=0.2)) is not None:
        got.append(msg)
    return got


def _started(link: DraftLink, draft: Channel) -> tuple[Sequence, m.SpecRequest]:
    """Sequence 7 (prompt 1, 2, 3) added, its first token (4) sampled and sent: the
    sequence and that first SpecRequest."""
    seq = _seq(7, [1, 2, 3])
    link.admit([seq])
    seq.token_ids.append(4)
    link.send_first_tokens([seq])
    *_, req = _take(draft)
    return seq, req


def _answer(draft: Channel, step: int, seq_id: int, rnd: int, tokens: list[int]) -> None:
    draft.send(m.SpecResponse(step=step, seq_ids=np.array([seq_id]), rounds=np.array([rnd]),
                              draft_token_ids=np.array([tokens]), num_draft_tokens=np.array([len(tokens)], np.int32),
                              cache_hit=np.array([False])))


def test_the_link_keeps_each_sequence_in_sync(pair):
    link, draft = pair
    seq = _seq(7, [1, 2, 3])
    link.admit([seq])
    seq.token_ids.append(4)  # the first token, sampled after prefill
    link.send_first_tokens([seq])
    add, req = _take(draft)
    assert isinstance(add, m.AddSequence) and add.prompt_token_ids.tolist() == [1, 2, 3]
    assert isinstance(req, m.SpecRequest) and req.rounds.tolist() == [1] and req.seq_lens.tolist() == [4]
    _answer(draft, req.step, 7, 1, [5, 6, 7])
    specs = link.collect([seq])
    assert specs[7].draft_token_ids.tolist() == [5, 6, 7]

    # Outcome (2 accepted, then 9): the next round is 2, with the confirmed length.
    assert link.send_outcomes([seq], specs, [2], [[5, 6, 9, 0]], True, lambda n: n == 1) is True
    (req,) = _take(draft)
    assert (req.rounds.tolist(), req.num_accepted.tolist(), req.token_ids.tolist(), req.seq_lens.tolist(),
            req.work_ahead) == ([2], [2], [9], [7], True)
    seq.token_ids += [5, 6, 9]

    # The draft comes back (restart or stall): the sequence is released, re-added and
    # given its outcome again before it is speculated.
    link.generation += 1
    link.check()
    with ThreadPoolExecutor(1) as pool:
        collecting = pool.submit(link.collect, [seq])
        rel, add, req = _take(draft)
        assert isinstance(rel, m.Release) and rel.seq_ids.tolist() == [7]
        assert add.prompt_token_ids.tolist() == [1, 2, 3, 4, 5, 6]
        assert req.rounds.tolist() == [3] and req.num_accepted.tolist() == [0] and req.token_ids.tolist() == [9]
        _answer(draft, req.step, 7, 3, [8])
        assert collecting.result(timeout=10)[7].draft_token_ids.tolist() == [8]

    link.finish(7)
    (rel,) = _take(draft)
    assert isinstance(rel, m.Release) and 7 not in link.rounds and 7 not in link.synced


def test_a_plain_step_asks_for_no_answer_and_the_next_step_waits_for_none(pair):
    link, draft = pair
    seq, req = _started(link, draft)
    _answer(draft, req.step, 7, 1, [5])
    specs = link.collect([seq])
    # A plain step: its outcome (0, 8) is held for the next request (asking for no answer).
    link.send_outcomes([seq], specs, [0], [[8, 0]], False, lambda n: PLAIN)
    assert draft.recv(timeout_s=0.3) is None
    seq.token_ids.append(8)
    # The next step speculates: the sequence verifies nothing, with no wait (the link's
    # draft timeout is 5 s) and no re-add, and its outcome goes out against round 3,
    # right after the held one.
    t0 = time.monotonic()
    specs = link.collect([seq])
    assert time.monotonic() - t0 < 1.0 and specs[7].num_draft_tokens == 0 and 7 in link.synced
    link.send_outcomes([seq], specs, [0], [[9, 0]], True, lambda n: SD)
    held, req = _take(draft)
    assert (held.work_ahead, held.backup, held.rounds.tolist(), held.token_ids.tolist()) == (False, "none", [2], [8])
    assert (req.work_ahead, req.backup, req.rounds.tolist(), req.seq_lens.tolist()) == (False, "", [3], [6])
    seq.token_ids.append(9)
    # That step asked for an answer: the one after waits for it.
    with ThreadPoolExecutor(1) as pool:
        collecting = pool.submit(link.collect, [seq])
        assert draft.recv(timeout_s=0.3) is None and not collecting.done()
        _answer(draft, req.step, 7, 3, [4, 4])
        assert collecting.result(timeout=10)[7].draft_token_ids.tolist() == [4, 4]


def _two_started(link, draft) -> tuple[Sequence, Sequence]:
    """Sequences 1 and 2 added, prefilled and given their first outcome (round 1)."""
    a, b = _seq(1, [1, 2, 3]), _seq(2, [4, 5, 6])
    link.admit([a, b])
    for s in (a, b):
        s.token_ids.append(9)
    link.send_first_tokens([a, b])
    _take(draft)
    return a, b


def test_plain_outcomes_are_held_for_k_steps_in_order_and_dropped_on_release(pair):
    """K plain steps make one request (each sequence's rows in step order); a sequence
    that finishes meanwhile is released and its held outcomes never sent."""
    link, draft = pair
    a, b = _two_started(link, draft)
    _answer(draft, 1, 1, 1, [5])
    _answer(draft, 1, 2, 1, [5])
    specs = link.collect([a, b])
    link.send_outcomes([a, b], specs, [0, 0], [[10, 0], [20, 0]], True, lambda n: PLAIN)
    for s, t in ((a, 10), (b, 20)):
        s.token_ids.append(t)
    for step in range(1, K):
        assert draft.recv(timeout_s=0.2) is None
        link.send_outcomes([a, b], {}, [0, 0], [[10 + step, 0], [20 + step, 0]], False, lambda n: PLAIN)
        for s, t in ((a, 10 + step), (b, 20 + step)):
            s.token_ids.append(t)
    (req,) = _take(draft)
    assert (req.work_ahead, req.backup) == (False, "none")
    assert req.seq_ids.tolist() == [1, 2] * K and req.rounds.tolist() == [r for r in range(2, K + 2) for _ in "ab"]
    assert req.token_ids.tolist() == [t for i in range(K) for t in (10 + i, 20 + i)]
    assert req.seq_lens.tolist() == [n for i in range(K) for n in (5 + i, 5 + i)]
    link.send_outcomes([a, b], {}, [0, 0], [[30, 0], [40, 0]], False, lambda n: PLAIN)
    link.finish(2)
    (rel,) = _take(draft)
    assert isinstance(rel, m.Release) and rel.seq_ids.tolist() == [2]
    specs = link.collect([a])
    link.send_outcomes([a], specs, [0], [[31, 0]], True, lambda n: SD)
    held, req = _take(draft)
    assert held.seq_ids.tolist() == [1] and held.token_ids.tolist() == [30] and req.token_ids.tolist() == [31]


def test_a_request_reads_outcomes_and_plain_tuples_as_rows():
    """spec_request takes Outcomes (resyncs, first tokens) and the tuples of a plain step
    in the same field order, and gives each field its wire dtype."""
    from target_proc.speculation import Outcome, spec_request

    req = spec_request(7, [Outcome(3, 2, 1, 99, 40), (4, 5, 0, 11, 12)], K, work_ahead=False, backup="none")
    assert (req.step, req.k, req.work_ahead, req.backup) == (7, K, False, "none")
    assert req.seq_ids.tolist() == [3, 4] and req.rounds.tolist() == [2, 5]
    assert req.num_accepted.tolist() == [1, 0] and req.num_accepted.dtype == np.int32
    assert req.token_ids.tolist() == [99, 11] and req.seq_lens.tolist() == [40, 12]
    assert all(a.dtype == np.int64 and a.flags.c_contiguous for a in (req.seq_ids, req.rounds, req.token_ids))
    assert spec_request(8, [], K, work_ahead=True).seq_ids.shape == (0,)


def test_a_step_that_ends_a_sequence_sends_it_no_outcome(pair):
    """The draft need not follow a sequence whose step reaches max_tokens: the request
    carries only the others' outcomes."""
    link, draft = pair
    a, b = _two_started(link, draft)
    a.sampling.max_tokens = 3  # one token generated; this step's 1 accepted + 1 make 3
    _answer(draft, 1, 1, 1, [5])
    _answer(draft, 1, 2, 1, [5])
    specs = link.collect([a, b])
    link.send_outcomes([a, b], specs, [1, 1], [[5, 10], [5, 20]], True, lambda n: SD)
    (req,) = _take(draft)
    assert req.seq_ids.tolist() == [2] and req.token_ids.tolist() == [20] and req.seq_lens.tolist() == [6]
    assert link.rounds == {1: 1, 2: 2}


def test_a_sequence_that_ends_at_its_first_token_is_never_added(pair):
    link, draft = pair
    seq = _seq(3, [1, 2], max_tokens=1)
    link.admit([seq])
    link.send_first_tokens([seq])
    assert draft.recv(timeout_s=0.3) is None and not link.synced


def test_answers_taken_between_collects_wait_for_the_next(pair):
    link, draft = pair
    seq, _ = _started(link, draft)
    _answer(draft, 1, 7, 0, [9])  # a round nobody waits for
    _answer(draft, 1, 7, 1, [5, 6])  # the awaited round
    assert wait_until(lambda: (link._drain(), [int(x.rounds[0]) for x in link._stash])[1] == [1], 5.0)
    assert link.collect([seq])[7].draft_token_ids.tolist() == [5, 6] and not link._stash


def test_an_answer_for_the_other_half_waits_for_its_collect(pair):
    """Halves steps collect one half while the draft answers the other: an answer to a
    sequence that is not awaited now, taken by a drain or while waiting, stays for its own
    collect instead of leaving that sequence without a speculation."""
    link, draft = pair
    a, b = _two_started(link, draft)
    _answer(draft, 1, 2, 1, [7, 7])  # b's answer, drained before a's collect
    assert wait_until(lambda: (link._drain(), len(link._stash))[1] == 1, 5.0)
    with ThreadPoolExecutor(1) as pool:
        collecting = pool.submit(link.collect, [a])
        _answer(draft, 1, 1, 1, [8, 8])
        assert collecting.result(timeout=10)[1].draft_token_ids.tolist() == [8, 8]
    assert link.collect([b])[2].draft_token_ids.tolist() == [7, 7] and not link._stash


def _worker(link: DraftLink) -> tuple[TargetWorker, list]:
    sent: list = []
    clients = SimpleNamespace(send_to=lambda ident, msg: sent.append((ident, msg)) or True)
    runner = SimpleNamespace(layout=SimpleNamespace(max_model_len=64, num_blocks=8, block_size=16), eos_token_ids=[0],
                             tokenizer=None, vocab_size=64, tp=None, device=torch.device("cpu"))
    cfg = RuntimeConfig(spec=SpeculativeConfig(mode="sd", k=K), sched=SchedulerConfig(max_batch_size=8))
    return TargetWorker(cfg, runner, clients, link), sent


def test_stats_are_answered_at_once_without_asking_the_draft(pair):
    """A draft that does not read (stalled, SIGSTOP) cannot hold up a /metrics scrape."""
    link, draft = pair
    worker, sent = _worker(link)
    worker.on_client_message(b"scraper", m.StatsRequest())
    assert [(ident, type(msg)) for ident, msg in sent] == [(b"scraper", m.EngineStats)]
    st = sent[0][1]
    assert st.draft_alive and st.draft_num_seqs == -1  # nothing pushed yet
    assert draft.recv(timeout_s=0.3) is None  # the draft was asked nothing

    # The draft pushes its counters on its own; the next answer carries them.
    draft.send(m.DraftStats(num_seqs=2, num_cache_entries=5, num_requests=9, num_hits=4, num_misses=1,
                            answer_s=0.25, num_answers=9))
    assert wait_until(lambda: (link._drain(), link.last_stats)[1] is not None, 5.0)
    worker.on_client_message(b"scraper", m.StatsRequest())
    st = sent[-1][1]
    assert (st.draft_num_seqs, st.draft_num_cache_entries, st.draft_num_answers, st.draft_answer_s) == (2, 5, 9, 0.25)
    assert draft.recv(timeout_s=0.3) is None


def test_without_a_draft_the_worker_answers_the_same_fields():
    worker, sent = _worker(None)
    worker.on_client_message(b"c", m.StatsRequest())
    st = sent[0][1]
    assert not st.draft_alive and st.draft_num_seqs == -1 and st.hits_by_depth == [] and st.draft_timeout_s == 0.0
