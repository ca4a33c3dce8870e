"""How long a verify round waits for the draft's speculation."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class DraftTimeout:
    """How long a round waits for the draft: `draft_timeout_s` when set, else measured.

    Measured: FACTOR times a slowly decaying maximum of the draft's answer times (request
    sent to response received; a tree-cache miss answers slower than a hit, so a maximum,
    not a mean), never under FLOOR_S, and INITIAL_S until the first answer (which
    includes the draft's prefill). A busy machine slows every answer, so the timeout
    follows it instead of turning speculation off.
    """

    FACTOR = 4.0
    FLOOR_S = 1.0
    INITIAL_S = 10.0
    DECAY = 0.99  # per answer

    def __init__(self, configured_s: float | None):
        self.configured_s = configured_s
        self.slowest_s = 0.0  # the decaying maximum
        self._logged_s = 0.0

    @property
    def value(self) -> float:
        if self.configured_s is not None:
            return self.configured_s
        if self.slowest_s == 0.0:
            return self.INITIAL_S
        return max(self.FLOOR_S, self.FACTOR * self.slowest_s)

    def observe(self, answer_s: float) -> None:
        self.slowest_s = max(answer_s, self.slowest_s * self.DECAY)
        if self.configured_s is None and not 0.5 * self._logged_s <= self.value <= 2 * self._logged_s:
            self._logged_s = self.value
            logger.info("draft timeout %.2f s: %.0fx the draft's slowest recent answer (%.3f s), at least %.1f s "
                        "(--draft-timeout-s sets it)", self.value, self.FACTOR, self.slowest_s, self.FLOOR_S)
