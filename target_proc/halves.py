"""Halves steps (the SSD round policy's `halves`): SD rounds over one half of the running
batch at a time, in turn. While the target verifies one half, the draft chains the
other, whose outcome the step before sent it; each half's chain hides behind the other
half's verify."""

from __future__ import annotations


class Halves:
    """Which half of the batch each sequence is in, and whose turn it is."""

    def __init__(self):
        self.half: dict[int, int] = {}  # seq_id -> 0 or 1
        self.turn = 0  # the half the last step ran

    def next(self, seqs: list) -> list:
        """The sequences (with .seq_id) of the half whose turn it is now. Each sequence
        keeps its half, a new one joins the smaller, and a half that finishing sequences
        left two or more short takes one from the other. A batch of one is its own half."""
        live = {s.seq_id for s in seqs}
        half = self.half = {sid: h for sid, h in self.half.items() if sid in live}
        sizes = [0, 0]
        for h in half.values():
            sizes[h] += 1
        for s in seqs:
            if s.seq_id not in half:
                h = int(sizes[1] < sizes[0])
                half[s.seq_id] = h
                sizes[h] += 1
        for s in reversed(seqs):
            big = int(sizes[1] > sizes[0])
            if sizes[big] - sizes[1 - big] < 2:
                break
            if half[s.seq_id] == big:
                half[s.seq_id] = 1 - big
                sizes[big] -= 1
                sizes[1 - big] += 1
        self.turn ^= 1
        return [s for s in seqs if half[s.seq_id] == self.turn] or seqs
