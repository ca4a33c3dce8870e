"""How many branches each sequence gets in an SSD work-ahead.

A SpecRequest may name the branches per sequence (the target's round policy,
target_proc/round_policy.py, picks them from measured costs): `follow` takes that level of
the ladder. A request that names none leaves the choice to this module's own rule, below.

A work-ahead pays only if it ends before the target's next request: the draft answers
that request only after its work-ahead, so a tree that outlasts the verify delays every
round by the overrun. The tree step's cost grows with its branches, so each batch-size
bucket (a power of two, the tree graph's shape) has a ladder of branch counts per
sequence: the share of --tree-budget, then halves of it, down to a quarter.

After each work-ahead the draft measures two things:
  - work: the work-ahead's own time;
  - slack: how long it then waited for the target's next request (about zero when that
    request was already waiting: the tree overran).
work + slack is the window the target leaves (its verify and post-processing). Per
bucket the policy keeps a running mean of the window and of the work at each level, and
picks the largest level whose work is measured, or estimated from the level below, to
fit within the window. An overrun moves one level down at once; a level above is tried
when the one below leaves it room on the estimate (twice its work), after a pause, so
the choice does not oscillate. "fixed" (a pinned tree) keeps the budget's share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from spec_runtime.config import TREE_LEVELS as LEVELS  # noqa: F401 - the budget's share, then 1/2 and 1/4 of it
from spec_runtime.config import pow2_at_least as _pow2_at_least
from spec_runtime.config import tree_ladder as ladder

logger = logging.getLogger(__name__)


def scratch_rows_needed(spec_cfg, num_slots: int) -> int:
    """The draft's scratch rows: K per branch of every slot's largest tree."""
    return num_slots * spec_cfg.max_branches() * spec_cfg.k


def tree_shapes(spec_cfg, max_seqs: int) -> list[tuple[int, int]]:
    """(sequences, branches per sequence) of the tree-step CUDA graphs: one per power of
    two up to max_seqs (and max_seqs), branches padded to a power of two; unless the
    tree is pinned, also every smaller level of the ladder the round policy picks from."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_seqs)
    shapes = []
    for s in sizes:
        shapes += [(s, _pow2_at_least(q)) for q in spec_cfg.tree_levels(s)]
    return sorted(set(shapes))


def tree_local_rows(spec_cfg) -> int:
    """Rows a branch sees beyond its sequence's prefix: up to K accepted drafts, then K scratch rows."""
    return 2 * spec_cfg.k


_DECAY = 0.8  # weight of the running means' past
_OVERRUN_S = 1e-4  # a wait this short means the request was already queued
_PAUSE = 16  # rounds at a level before trying the one above


def bucket_of(num_seqs: int) -> int:
    return _pow2_at_least(num_seqs)


@dataclass
class _Bucket:
    levels: list[int]
    level: int = 0  # index into levels
    window_s: float | None = None
    work_s: dict[int, float] = field(default_factory=dict)  # level -> running mean
    rounds_at_level: int = 0


class TreeBudget:
    """Per batch-size bucket, the branches each sequence gets; see the module doc."""

    def __init__(self, top_for_bucket, policy: str = "auto") -> None:
        if policy not in ("auto", "fixed"):
            raise ValueError(f"tree shape policy must be auto or fixed, got {policy!r}")
        self.top_for_bucket = top_for_bucket  # bucket -> the budget's share (a power of two or less)
        self.policy = policy
        self.buckets: dict[int, _Bucket] = {}
        self.num_shrinks = 0
        self.num_grows = 0

    def _bucket(self, num_seqs: int) -> _Bucket:
        b = bucket_of(num_seqs)
        if b not in self.buckets:
            self.buckets[b] = _Bucket(ladder(self.top_for_bucket(b)))
        return self.buckets[b]

    def branches(self, num_seqs: int) -> int:
        """Branches per sequence for a work-ahead over num_seqs sequences."""
        st = self._bucket(num_seqs)
        return st.levels[st.level if self.policy == "auto" else 0]

    def follow(self, num_seqs: int, branches: int) -> int:
        """A request named `branches` per sequence: use the largest level of the ladder at
        most that (the smallest if none is), counting a move as a shrink or a grow."""
        st = self._bucket(num_seqs)
        if self.policy != "auto":
            return st.levels[0]  # a pinned tree: only its graph shape exists
        level = next((i for i, b in enumerate(st.levels) if b <= branches), len(st.levels) - 1)
        if level != st.level:
            if level > st.level:
                self.num_shrinks += 1
            else:
                self.num_grows += 1
            logger.debug("SSD tree, batch size ~%d: %d -> %d branches per sequence (as requested)",
                         bucket_of(num_seqs), st.levels[st.level], st.levels[level])
            st.level = level
            st.rounds_at_level = 0
        return st.levels[level]

    def observe(self, num_seqs: int, work_s: float, slack_s: float) -> None:
        """One work-ahead over num_seqs sequences took work_s, then the draft waited
        slack_s for the next request."""
        if self.policy != "auto":
            return
        st = self._bucket(num_seqs)
        lv = st.level
        prev = st.work_s.get(lv)
        st.work_s[lv] = work_s if prev is None else _DECAY * prev + (1 - _DECAY) * work_s
        st.rounds_at_level += 1
        overran = slack_s < _OVERRUN_S
        if not overran:
            w = work_s + slack_s
            st.window_s = w if st.window_s is None else _DECAY * st.window_s + (1 - _DECAY) * w
        if overran and lv + 1 < len(st.levels):
            self._move(num_seqs, st, lv + 1, f"the work-ahead ({1e3 * work_s:.2f} ms) outlasted the verify")
            self.num_shrinks += 1
            return
        if lv > 0 and st.window_s is not None and st.rounds_at_level >= _PAUSE:
            above = st.work_s.get(lv - 1, 2.0 * st.work_s[lv])
            if above < st.window_s:
                self._move(num_seqs, st, lv - 1, f"a larger tree fits the {1e3 * st.window_s:.2f} ms window")
                self.num_grows += 1

    def _move(self, num_seqs: int, st: _Bucket, level: int, why: str) -> None:
        logger.info("SSD tree, batch size ~%d: %d -> %d branches per sequence (%s)",
                    bucket_of(num_seqs), st.levels[st.level], st.levels[level], why)
        st.level = level
        st.rounds_at_level = 0

    def shapes(self) -> dict[int, int]:
        """Bucket -> branches per sequence now (for stats and logs)."""
        return {b: st.levels[st.level if self.policy == "auto" else 0] for b, st in sorted(self.buckets.items())}
