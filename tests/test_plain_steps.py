"""A plain step (the target decodes without speculation) asks the draft only to take in
the outcomes: it drafts nothing and answers nothing, as nobody waits for an answer, and
the next speculation equals that of a draft that saw the same tokens from the start."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import messages as m
from target_proc.round_policy import PLAIN
from test_draft_kv import K, _add, _worker


def _request(worker, chan, step: int, sid: int, rnd: int, token: int, num_accepted: int = 0, **kw):
    seq = worker.seqs[sid]
    chan.inbox.append(m.SpecRequest(
        step=step, seq_ids=np.array([sid], np.int64), rounds=np.array([rnd]), num_accepted=np.array([num_accepted],
        np.int32), token_ids=np.array([token]), seq_lens=np.array([seq.num_tokens + num_accepted + 1], np.int64),
        k=K, **kw))
    while chan.inbox:
        worker.run_once()
    sent, chan.sent[:] = list(chan.sent), []
    if kw.get("backup") == PLAIN.backup and not kw.get("work_ahead", True):
        assert sent == [], "a plain step was answered"
        return None
    (resp,) = sent
    assert isinstance(resp, m.SpecResponse), resp
    return resp


@pytest.mark.parametrize("keep_up", [False, True])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_plain_steps_draft_nothing_and_the_next_speculation_is_unchanged(tiny_llama_dir, mode, keep_up, monkeypatch):
    """Without keep_up (a draft that shares the target's device) a plain step runs no
    forward; with it, one forward of one token per sequence, so the next chain catches up
    on two tokens only. Either way the next speculation is a cold draft's."""
    assert PLAIN.backup == "none" and not PLAIN.work_ahead
    prompt = [5, 9, 14, 3, 22, 40]
    worker, chan = _worker(tiny_llama_dir, mode=mode)
    worker.keep_up = keep_up
    _add(worker, chan, 1, prompt)
    first = _request(worker, chan, 1, 1, 1, 7, work_ahead=False)
    assert int(first.num_draft_tokens[0]) == K
    # Three plain steps: the outcome (0, t) of each.
    runner = worker.speculator.runner
    real_run, fed = runner.run, []

    def run(items):
        if not keep_up:
            pytest.fail("a plain step ran a forward")
        fed.append([len(it.token_ids) for it in items])
        return real_run(items)

    monkeypatch.setattr(runner, "run", run)
    tokens = [11, 12, 13]
    for i, t in enumerate(tokens):
        _request(worker, chan, 2 + i, 1, 2 + i, t, work_ahead=False, backup=PLAIN.backup)
        seq = worker.seqs[1]
        if keep_up:  # every confirmed token but the last has its KV
            assert seq.num_cached == seq.num_tokens - 1
    # The first plain step has nothing to feed (the chain before it computed x_n's KV);
    # each later one feeds the token before its own.
    assert fed == ([[1], [1]] if keep_up else [])
    monkeypatch.undo()
    # The next chain's first step: two tokens (a graph's shape) once kept up, else all four since.
    catch_up, first_step = worker.speculator.catch_up_items, []
    monkeypatch.setattr(worker.speculator, "catch_up_items",
                        lambda seqs: first_step.append(items := catch_up(seqs)) or items)
    after = _request(worker, chan, 5, 1, 5, 30, work_ahead=False)
    assert [len(it.token_ids) for it in first_step[0]] == [2 if keep_up else 1 + len(tokens)]
    # A draft that saw prompt + 7 + the plain steps' tokens as its prompt.
    cold, cold_chan = _worker(tiny_llama_dir, mode=mode)
    _add(cold, cold_chan, 1, prompt + [7] + tokens)
    ref = _request(cold, cold_chan, 1, 1, 1, 30, work_ahead=False)
    assert int(after.num_draft_tokens[0]) == K
    np.testing.assert_array_equal(after.draft_token_ids, ref.draft_token_ids)


@pytest.mark.parametrize("before, drafts", [
    (dict(work_ahead=False), K),  # an SD round: no tree behind the next answer, which gets a chain
    (dict(work_ahead=False, backup=PLAIN.backup), 0),  # a plain step: the next answer drafts nothing
])
def test_the_first_answer_after_sd_rounds_is_a_chain_whatever_backup_it_names(tiny_llama_dir, before, drafts):
    """The round policy switches from SD rounds to SSD rounds with no backup: the answer to
    that request has no tree behind it (the draft did not work ahead during the SD round),
    and answering its 'misses' with no drafts would verify one token per sequence."""
    worker, chan = _worker(tiny_llama_dir, mode="ssd")
    _add(worker, chan, 1, [5, 9, 14, 3, 22, 40])
    _request(worker, chan, 1, 1, 1, 7, **before)
    resp = _request(worker, chan, 2, 1, 2, 11, work_ahead=True, backup="none")
    assert int(resp.num_draft_tokens[0]) == drafts
    assert not resp.cache_hit[0]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_plain_steps_held_by_the_target_are_taken_in_together(tiny_llama_dir, mode, monkeypatch):
    """The target sends the outcomes of up to K plain steps in one request, each sequence's
    rows in order (target_proc.draft_link): the draft applies them in order, feeds them in
    one forward of at most K + 1 tokens per sequence, and its next speculation is a cold
    draft's."""
    prompts = {1: [5, 9, 14, 3, 22, 40], 2: [8, 1, 30, 12]}
    worker, chan = _worker(tiny_llama_dir, mode=mode)
    worker.keep_up = True
    for sid, p in prompts.items():
        _add(worker, chan, sid, p)
    chan.inbox.append(m.SpecRequest(step=1, seq_ids=np.array([1, 2]), rounds=np.array([1, 1]),
                                    num_accepted=np.zeros(2, np.int32), token_ids=np.array([7, 7]),
                                    seq_lens=np.array([len(prompts[1]) + 1, len(prompts[2]) + 1]), k=K,
                                    work_ahead=False))
    while chan.inbox:
        worker.run_once()
    chan.sent.clear()
    held = {1: [11, 12, 13], 2: [21, 22, 23]}
    rows = [(sid, i) for i in range(K) for sid in (1, 2)]
    runner = worker.speculator.runner
    real_run, fed = runner.run, []
    monkeypatch.setattr(runner, "run", lambda items: (fed.append([len(it.token_ids) for it in items]),
                                                      real_run(items))[1])
    chan.inbox.append(m.SpecRequest(
        step=2, seq_ids=np.array([sid for sid, _ in rows]), rounds=np.array([2 + i for _, i in rows]),
        num_accepted=np.zeros(len(rows), np.int32), token_ids=np.array([held[sid][i] for sid, i in rows]),
        seq_lens=np.array([len(prompts[sid]) + 2 + i for sid, i in rows]), k=K, work_ahead=False,
        backup=PLAIN.backup))
    while chan.inbox:
        worker.run_once()
    monkeypatch.undo()
    assert chan.sent == [] and len(fed) == 1 and max(fed[0]) <= K + 1
    for sid in prompts:
        seq = worker.seqs[sid]
        assert seq.token_ids == prompts[sid] + [7] + held[sid] and seq.num_cached == seq.num_tokens - 1
    for sid in prompts:
        after = _request(worker, chan, 3 + sid, sid, 2 + K, 30, work_ahead=False)
        cold, cold_chan = _worker(tiny_llama_dir, mode=mode)
        _add(cold, cold_chan, sid, prompts[sid] + [7] + held[sid])
        ref = _request(cold, cold_chan, 1, sid, 1, 30, work_ahead=False)
        np.testing.assert_array_equal(after.draft_token_ids, ref.draft_token_ids)


@pytest.mark.parametrize("target, tp, draft, own", [
    ("cuda:0", 1, "cuda:1", True),
    ("cuda:0", 1, "cuda:0", False),  # shares the target's GPU: its forward would compete with the verify
    ("cuda:0", 2, "cuda:1", False),  # the target's second rank is on cuda:1
    ("cpu", 1, "cpu", False),
])
def test_the_draft_keeps_up_by_default_only_on_a_gpu_of_its_own(tiny_llama_dir, target, tp, draft, own):
    from draft_proc.worker import draft_has_own_gpu
    from spec_runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig

    cfg = RuntimeConfig(target=ModelConfig(path=tiny_llama_dir, device=target, tensor_parallel_size=tp),
                        draft=ModelConfig(path=tiny_llama_dir, device=draft), spec=SpeculativeConfig(mode="ssd", k=K))
    assert draft_has_own_gpu(cfg) is own
