"""When to speculate: per step, by measured throughput at the current batch size.

Speculation pays while the draft's cost per round is small against the verify; at
large batch the target's forward grows and acceptance gains shrink, and plain decoding
can win (measured on two H200s, target-32b + draft-0.6b, T=0.7: at batch 16 AR gave
668 tok/s against 542 for SSD and 476 for SD; at T=0 speculation still won at 16; see
bench/results/). The crossover depends on the models, the temperature and the text, so
the policy measures instead of guessing:

  - "always": speculate every step (the default: deterministic behaviour);
  - "adaptive": per batch-size bucket (powers of two), keep a running average of the
    tokens/s of speculative steps and of plain steps, use the faster, and re-measure
    the other one every `probe_every` steps, for `probe_len` steps of which the first
    (a transition: the draft may still be busy with the other mode's work) is not
    counted. Below `min_batch` it always speculates.

Pure bookkeeping, no torch: the worker asks `use_speculation(batch)` before a step and
reports `record(batch, speculated, num_tokens, seconds)` after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    spec_rate: float | None = None  # tokens/s of speculative steps (running average)
    plain_rate: float | None = None
    steps_since_probe: int = 0
    speculating: bool = True
    probing: int = 0  # steps left in a probe of the mode not in use
    last: bool = True  # the mode of the last step, to skip transitions


class SpecPolicy:
    def __init__(self, policy: str = "always", probe_every: int = 64, min_batch: int = 4, smoothing: float = 0.2,
                 probe_len: int = 3):
        if policy not in ("always", "adaptive"):
            raise ValueError(f"spec policy must be always or adaptive, got {policy!r}")
        if probe_every < 2:
            raise ValueError("probe_every must be >= 2")
        self.policy = policy
        self.probe_every = probe_every
        self.min_batch = min_batch
        self.smoothing = smoothing
        self.probe_len = probe_len
        self._buckets: dict[int, _Bucket] = {}
        self.num_plain_steps = 0

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def use_speculation(self, batch: int) -> bool:
        if self.policy == "always" or batch < self.min_batch:
            return True
        b = self._buckets.setdefault(self.bucket(batch), _Bucket())
        if b.probing:
            b.probing -= 1
            return not b.speculating
        if b.spec_rate is None:
            return True
        if b.plain_rate is None:  # measure plain decoding once
            b.probing = self.probe_len - 1
            return False
        b.steps_since_probe += 1
        if b.steps_since_probe >= self.probe_every:
            b.steps_since_probe = 0
            b.probing = self.probe_len - 1
            return not b.speculating  # probe the other mode
        return b.speculating

    def record(self, batch: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        if self.policy == "always" or seconds <= 0:
            return
        if not speculated:
            self.num_plain_steps += 1
        if batch < self.min_batch:
            return
        key = self.bucket(batch)
        b = self._buckets.setdefault(key, _Bucket())
        if speculated != b.last:
            b.last = speculated
            return  # a transition step measures neither mode
        rate = num_tokens / seconds
        if speculated:
            b.spec_rate = rate if b.spec_rate is None else (1 - self.smoothing) * b.spec_rate + self.smoothing * rate
        else:
            b.plain_rate = rate if b.plain_rate is None else (1 - self.smoothing) * b.plain_rate + self.smoothing * rate
        if b.spec_rate is not None and b.plain_rate is not None and not b.probing:
            faster = b.spec_rate >= b.plain_rate
            if faster != b.speculating:
                b.speculating = faster
                logger.warning(
                    "batch size ~%d: %s measured faster (%.0f vs %.0f tok/s); %s speculation",
                    key, "speculation" if faster else "plain decoding", max(b.spec_rate, b.plain_rate),
                    min(b.spec_rate, b.plain_rate), "resuming" if faster else "pausing",
                )


@dataclass
class _WorkAheadBucket:
    round_s: dict = None  # {work_ahead: running mean step seconds}
    counts: dict = None  # {work_ahead: measured steps}
    choice: bool = True
    probing: int = 0  # steps left in a probe of the other choice
    steps_since_probe: int = 0
    announced: bool = False

    def __post_init__(self):
        self.round_s = {True: None, False: None}
        self.counts = {True: 0, False: 0}


class WorkAheadPolicy:
    """SSD or synchronous SD, per batch-size bucket, by measured step time.

    In SSD mode every SpecRequest says whether the draft works ahead after answering
    it. Working ahead makes the next round's look-up a hit, answered at once; not
    working ahead makes the next answer a chain drafted on request (synchronous SD).
    Both give speculations of the same distribution (a branch holds exactly the
    tokens and q the chain drafter would produce), so the expected tokens per round
    are the same and the faster round wins: the policy keeps a running mean of the
    step time under each choice (the worker reports a step only when the three requests
    before it made the same choice) and uses the shorter. SSD loses where the draft's work-ahead outlasts
    the verify, or where misses are frequent enough that the backup chain runs anyway.

    "always" works ahead every round; "auto" starts with SSD, measures `warmup` SSD
    steps, then `probe_len` SD steps, and re-measures the choice not in use every
    `probe_every` steps. Pure bookkeeping, no torch.
    """

    def __init__(self, policy: str = "auto", warmup: int = 8, probe_len: int = 8, probe_every: int = 128,
                 smoothing: float = 0.2):
        if policy not in ("auto", "always"):
            raise ValueError(f"work-ahead policy must be auto or always, got {policy!r}")
        self.policy = policy
        self.warmup = warmup
        self.probe_len = probe_len
        self.probe_every = probe_every
        self.smoothing = smoothing
        self._buckets: dict[int, _WorkAheadBucket] = {}
        self.num_work_ahead = 0  # requests sent with work_ahead (SSD rounds)
        self.num_sync = 0  # requests sent without (SD rounds)

    def work_ahead(self, batch: int) -> bool:
        """The flag of the request sent now, for a batch of `batch` sequences."""
        choice = True if self.policy == "always" else self._choose(batch)
        if choice:
            self.num_work_ahead += 1
        else:
            self.num_sync += 1
        return choice

    def _choose(self, batch: int) -> bool:
        key = SpecPolicy.bucket(batch)
        b = self._buckets.setdefault(key, _WorkAheadBucket())
        if b.probing:
            b.probing -= 1
            return not b.choice
        if b.counts[True] >= self.warmup and b.counts[False] == 0:
            b.probing = self.probe_len - 1  # first measurement of SD
            return False
        b.steps_since_probe += 1
        if b.counts[False] and b.steps_since_probe >= self.probe_every:
            b.steps_since_probe = 0
            b.probing = self.probe_len - 1
            return not b.choice
        return b.choice

    def record(self, batch: int, work_ahead: bool, seconds: float) -> None:
        """A speculative step of `batch` sequences took `seconds`, after a request sent
        with `work_ahead`."""
        if self.policy == "always" or seconds <= 0:
            return
        key = SpecPolicy.bucket(batch)
        b = self._buckets.setdefault(key, _WorkAheadBucket())
        old = b.round_s[work_ahead]
        b.round_s[work_ahead] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds
        b.counts[work_ahead] += 1
        ssd, sd = b.round_s[True], b.round_s[False]
        if ssd is None or sd is None or b.probing:
            return
        better = ssd <= sd
        if not b.announced:
            b.announced = True
            logger.info("batch size ~%d: SSD rounds %.2f ms, synchronous SD rounds %.2f ms per step; using %s",
                        key, 1e3 * ssd, 1e3 * sd, "SSD" if better else "SD")
            b.choice = better
        elif better != b.choice:
            b.choice = better
            logger.info("batch size ~%d: %s rounds measured faster (%.2f vs %.2f ms per step); switching to %s",
                        key, "SSD" if better else "synchronous SD", 1e3 * min(ssd, sd), 1e3 * max(ssd, sd),
                        "SSD" if better else "SD")

    def summary(self) -> dict[int, str]:
        """The choice per bucket with a measurement of both, for logs and stats."""
        return {k: ("ssd" if b.choice else "sd") for k, b in sorted(self._buckets.items()) if all(b.counts.values())}
