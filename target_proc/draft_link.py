"""target_proc's end of the spec link: send outcomes, collect speculations.

The draft is a helper, never a dependency: a speculation that does not arrive within
`draft_timeout_s` is not waited for (that round verifies nothing, which is plain decoding),
a response for a round we no longer wait for is stale and dropped, and a sequence
whose draft state may be out of date is re-added before it is speculated again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from protocol.codec import ProtocolError
from protocol.messages import (
    AddSequence,
    DraftStats,
    DraftStatsRequest,
    ErrorReply,
    Release,
    SpecRequest,
    SpecResponse,
)

logger = logging.getLogger(__name__)


@dataclass
class Speculation:
    """The draft's proposal for one sequence and round."""

    draft_token_ids: np.ndarray  # [m] int64, m <= K
    q_token_ids: np.ndarray | None  # [m, top_k] int64, None when greedy
    q_probs: np.ndarray | None  # [m, top_k] float32
    cache_hit: bool


@dataclass
class Outcome:
    seq_id: int
    round: int
    num_accepted: int
    token_id: int  # recovery or bonus token
    seq_len: int  # confirmed length including token_id


class DraftLink:
    def __init__(self, channel, timeout_s: float, k: int):
        self.channel = channel
        self.timeout_s = timeout_s
        self.k = k
        self.alive = True
        self.step = 0
        self.desynced: set[int] = set()
        self.last_stats: DraftStats | None = None
        self.last_draft_work_s = 0.0
        self.num_timeouts = 0

    def add(self, seq_id: int, token_ids: list[int], temperature: float, top_k: int, top_p: float, seed: int) -> None:
        self.channel.send(
            AddSequence(
                seq_id=seq_id,
                prompt_token_ids=np.asarray(token_ids, dtype=np.int64),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
            )
        )

    def request(self, outcomes: list[Outcome]) -> None:
        if not outcomes:
            return
        self.step += 1
        self.channel.send(
            SpecRequest(
                step=self.step,
                seq_ids=np.fromiter((o.seq_id for o in outcomes), np.int64, len(outcomes)),
                rounds=np.fromiter((o.round for o in outcomes), np.int64, len(outcomes)),
                num_accepted=np.fromiter((o.num_accepted for o in outcomes), np.int32, len(outcomes)),
                token_ids=np.fromiter((o.token_id for o in outcomes), np.int64, len(outcomes)),
                seq_lens=np.fromiter((o.seq_len for o in outcomes), np.int64, len(outcomes)),
                k=self.k,
            )
        )

    def release(self, seq_ids: list[int]) -> None:
        if seq_ids:
            self.channel.send(Release(seq_ids=np.asarray(seq_ids, dtype=np.int64)))

    def query_stats(self, timeout_s: float = 1.0) -> DraftStats | None:
        self.channel.send(DraftStatsRequest())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self._recv(deadline - time.monotonic())
            if isinstance(msg, DraftStats):
                self.last_stats = msg
                return msg
            if msg is not None:
                self._handle_other(msg, {})
        return None

    def collect(self, waiting: dict[int, int]) -> dict[int, Speculation]:
        """Wait for the speculations of `waiting` ({seq_id: round}).

        Returns what arrived in time; sequences missing from the result get no
        speculation this round (the caller decodes them plainly and re-syncs them).
        """
        got: dict[int, Speculation] = {}
        if not waiting:
            return got
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(waiting):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.num_timeouts += 1
                logger.warning(
                    "draft did not answer %d of %d sequences within %.2fs; decoding them without speculation",
                    len(waiting) - len(got), len(waiting), self.timeout_s,
                )
                break
            msg = self._recv(remaining)
            if msg is None:
                continue
            if isinstance(msg, SpecResponse):
                self._take_response(msg, waiting, got)
            else:
                self._handle_other(msg, waiting)
                # A desync error for a sequence we wait for: it will not be answered.
                for sid in list(waiting):
                    if sid in self.desynced and sid not in got:
                        waiting = {s: r for s, r in waiting.items() if s != sid}
        return got

    def _take_response(self, msg: SpecResponse, waiting: dict[int, int], got: dict[int, Speculation]) -> None:
        self.last_draft_work_s = msg.draft_work_s
        has_q = msg.q_token_ids is not None and msg.q_probs is not None and msg.q_token_ids.size > 0
        for b in range(len(msg.seq_ids)):
            sid = int(msg.seq_ids[b])
            if waiting.get(sid) != int(msg.rounds[b]):
                continue  # stale: a round we stopped waiting for, or a released sequence
            m = int(msg.num_draft_tokens[b])
            if not 0 <= m <= msg.draft_token_ids.shape[1]:
                logger.warning("draft sent num_draft_tokens=%d for seq %d; ignoring it", m, sid)
                self.desynced.add(sid)
                continue
            got[sid] = Speculation(
                draft_token_ids=msg.draft_token_ids[b, :m].astype(np.int64, copy=False),
                q_token_ids=msg.q_token_ids[b, :m] if has_q else None,
                q_probs=msg.q_probs[b, :m] if has_q else None,
                cache_hit=bool(msg.cache_hit[b]),
            )

    def _handle_other(self, msg, waiting: dict[int, int]) -> None:
        if isinstance(msg, ErrorReply):
            if msg.seq_id >= 0:
                logger.info("draft could not serve seq %d (%s: %s); it will be re-added", msg.seq_id, msg.code, msg.message)
                self.desynced.add(msg.seq_id)
            else:
                logger.warning("draft error %s: %s", msg.code, msg.message)
        elif isinstance(msg, DraftStats):
            self.last_stats = msg

    def _recv(self, timeout_s: float):
        try:
            return self.channel.recv(timeout_s=max(0.0, timeout_s))
        except ProtocolError as e:
            logger.warning("dropping a malformed message from the draft: %s", e)
            return None
