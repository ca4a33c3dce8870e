"""Draft and target must read token ids alike; a draft id the target has no row for is
rejected by the verifier, never looked up (a lookup would kill the target with an IndexError).

  - a draft with another tokenizer: a clear start-up error naming both, no orphans;
  - a draft of the same tokenizer with a padded embedding (512 rows against the
    target's 384), which proposes ids >= 384: it serves, greedy output equals the
    target alone, the target lives, and the cut speculations are logged;
  - DraftLink cuts a speculation at its first out-of-vocabulary id (draft or q), and
    drops a response whose arrays do not fit together.
"""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from conftest import save_tiny_model, tiny_tokenizer
from e2e_util import make_config, random_prompts, wait_until
from protocol.messages import SamplingParams, SpecResponse
from spec_runtime.client import Client
from spec_runtime.launcher import Launcher, StartupError
from target_proc.draft_link import DraftLink

SP = SamplingParams(max_tokens=24, ignore_eos=True)


class _FakeChannel:
    """Enough of a Channel for DraftLink's bookkeeping (no socket is used)."""

    class socket:  # noqa: N801 - stands in for the zmq socket
        @staticmethod
        def get_monitor_socket(*_):
            return None

    def connect(self, _address: str) -> None:
        pass


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


def test_draft_with_another_tokenizer_is_a_startup_error(tmp_path):
    target = save_tiny_model(tmp_path / "t", "llama")
    draft = save_tiny_model(tmp_path / "d", "llama")
    other = tiny_tokenizer().__class__.from_pretrained(draft)
    other.add_tokens(["<|only-in-the-draft|>"])
    other.save_pretrained(draft)
    before = _children()
    with pytest.raises(StartupError, match="different tokenizers.*draft .*target"):
        Launcher(make_config(target, draft, mode="sd"))
    assert _children() <= before


def test_padded_draft_vocabulary_serves_exactly(tmp_path, capfd, ar_reference):
    target = save_tiny_model(tmp_path / "t", "llama")
    # Same tokenizer, 512 embedding rows: a random draft proposes ids >= 384 often.
    draft = save_tiny_model(tmp_path / "d", "llama", seed=3, vocab_size=512)
    prompts = random_prompts(384, seed=11)
    ref = ar_reference(target, prompts, SP.max_tokens)
    with Client(make_config(target, draft, mode="sd", k=4)) as c:
        assert c.ready.vocab_size == 384 and c.launcher.ready["draft"].vocab_size == 512
        before = c.engine_stats()
        got = [r.token_ids for r in c.generate_batch(prompts, SP)]
        assert c.launcher.dead_child() is None and c.health() == "ok"
        assert c.engine_stats().totals.num_draft_tokens > 0
        # The draft pushes its counters on its own, at the latest when it goes idle: the
        # target's copy lags, so wait for it (a short run may end before the first push).
        assert wait_until(lambda: c.engine_stats().draft_num_answers > before.draft_num_answers, 10.0)
    assert got == ref
    assert "outside the target's vocabulary of 384" in capfd.readouterr().err


def test_draft_link_cuts_at_the_first_out_of_vocabulary_id():
    link = DraftLink(_FakeChannel(), "ipc://unused", timeout_s=1.0, k=4, vocab_size=100)

    def take(draft_row, q_rows=None):
        msg = SpecResponse(step=1, seq_ids=np.array([7]), rounds=np.array([1]),
                           draft_token_ids=np.array([draft_row]), num_draft_tokens=np.array([4], np.int32),
                           cache_hit=np.array([False]),
                           q_token_ids=None if q_rows is None else np.array([q_rows]),
                           q_probs=None if q_rows is None else np.full((1, 4, 2), 0.5, np.float32))
        got = {}
        link._take_response(msg, {7: 1}, got)
        return got[7]

    assert take([1, 2, 3, 4]).draft_token_ids.tolist() == [1, 2, 3, 4]
    assert take([1, 2, 100, 4]).draft_token_ids.tolist() == [1, 2]
    assert take([-1, 2, 3, 4]).draft_token_ids.tolist() == []
    spec = take([1, 2, 3, 4], [[1, 0], [2, 5], [3, 250], [4, 0]])
    assert spec.draft_token_ids.tolist() == [1, 2] and spec.q_token_ids.shape == (2, 2) and spec.q_probs.shape == (2, 2)
    assert link.num_out_of_vocab == 2 + 4 + 2


def test_draft_link_drops_a_response_whose_arrays_do_not_fit():
    link = DraftLink(_FakeChannel(), "ipc://unused", timeout_s=1.0, k=2, vocab_size=100)
    good = dict(step=1, seq_ids=np.array([7, 8]), rounds=np.array([1, 1]), draft_token_ids=np.array([[1, 2], [3, 4]]),
                num_draft_tokens=np.array([2, 2], np.int32), cache_hit=np.array([False, False]))
    for bad in ({"rounds": np.array([1])}, {"num_draft_tokens": np.array([2], np.int32)},
                {"draft_token_ids": np.array([1, 2])}, {"cache_hit": np.array([True])},
                {"q_token_ids": np.zeros((2, 2, 3), np.int64)}):
        got = {}
        link._take_response(SpecResponse(**{**good, **bad}), {7: 1, 8: 1}, got)
        assert got == {}
    got = {}
    link._take_response(SpecResponse(**good), {7: 1, 8: 1}, got)
    assert sorted(got) == [7, 8]
