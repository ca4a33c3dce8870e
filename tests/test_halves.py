"""target_proc.halves: which half of the batch a halves step runs."""

from __future__ import annotations

from types import SimpleNamespace

from target_proc.halves import Halves


def _seqs(ids):
    return [SimpleNamespace(seq_id=i) for i in ids]


def test_the_halves_take_turns_and_each_sequence_keeps_its_half():
    h = Halves()
    seqs = _seqs(range(6))
    first, second = h.next(seqs), h.next(seqs)
    assert len(first) == len(second) == 3
    assert {s.seq_id for s in first} | {s.seq_id for s in second} == set(range(6))
    assert [s.seq_id for s in h.next(seqs)] == [s.seq_id for s in first]  # the same half again


def test_new_sequences_join_the_smaller_half_and_a_half_left_short_takes_one():
    h = Halves()
    seqs = _seqs(range(6))
    h.next(seqs)
    one = [sid for sid, half in h.half.items() if half == 1]
    # Two of half 1 finish, and a new sequence arrives: it joins half 1, now 2 against 3.
    left = [s for s in seqs if s.seq_id not in one[:2]] + _seqs([9])
    h.next(left)
    assert h.half[9] == 1 and sorted(h.half.values()).count(1) == 2
    # All three of half 1 finish: half 0 gives one of its three.
    rest = [s for s in left if h.half[s.seq_id] == 0]
    h.next(rest)
    assert sorted(h.half.values()) == [0, 0, 1]


def test_a_batch_of_one_runs_every_step():
    h = Halves()
    seqs = _seqs([4])
    assert [s.seq_id for s in h.next(seqs)] == [4] and [s.seq_id for s in h.next(seqs)] == [4]
