"""When to speculate (SD mode): per step, by measured throughput at the current batch size.

SSD mode chooses among SSD rounds, SD rounds and plain steps in target_proc/round_policy.py.

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


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch`: both policies keep their measurements per bucket."""
    return 1 << max(0, (batch - 1).bit_length())


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

    bucket = staticmethod(batch_bucket)

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
