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


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_plain_steps_draft_nothing_and_the_next_speculation_is_unchanged(tiny_llama_dir, mode, monkeypatch):
    assert PLAIN.backup == "none" and not PLAIN.work_ahead
    prompt = [5, 9, 14, 3, 22, 40]
    worker, chan = _worker(tiny_llama_dir, mode=mode)
    _add(worker, chan, 1, prompt)
    first = _request(worker, chan, 1, 1, 1, 7, work_ahead=False)
    assert int(first.num_draft_tokens[0]) == K
    # Three plain steps: the outcome (0, t) of each; no forward may run for them.
    def no_forward(*args, **kwargs):
        pytest.fail("a plain step ran a forward")

    monkeypatch.setattr(worker.speculator.runner, "run", no_forward)
    tokens = [11, 12, 13]
    for i, t in enumerate(tokens):
        _request(worker, chan, 2 + i, 1, 2 + i, t, work_ahead=False, backup=PLAIN.backup)
    monkeypatch.undo()
    after = _request(worker, chan, 5, 1, 5, 30, work_ahead=False)
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
