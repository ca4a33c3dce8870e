"""target_proc's end of the spec link: send outcomes, collect speculations.

The draft is a helper, never a dependency:
  - a speculation that does not arrive within the draft timeout is not waited for (that
    round verifies nothing, which is plain decoding), and the draft is then *suspect*:
    no round waits on it again until it answers a probe (a stalled draft costs one
    timeout, not one per round);
  - a dead draft is noticed from the socket itself (a zmq monitor reports the
    disconnect), and sends never block (NOBLOCK);
  - a response for a round we no longer wait for is stale and dropped;
  - a draft token id outside the target's vocabulary can never be accepted: the
    speculation is cut before it (a shorter speculation is still exact) and logged;
  - whenever the draft comes back (reconnected after a restart, or answering again
    after a stall) `generation` grows, and the worker re-adds every sequence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.codec import ProtocolError, encode
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
    def __init__(self, channel, address: str, timeout_s: float | None, k: int, vocab_size: int | None = None):
        """channel: an unconnected PAIR Channel; the link connects it to `address` once
        its monitor is attached, so the first connect is seen too. timeout_s: None measures
        it. vocab_size: the target's; draft token ids outside [0, vocab_size) are treated
        as rejected."""
        self.channel = channel
        self.vocab_size = vocab_size
        self.num_out_of_vocab = 0  # draft tokens cut because the target has no such id
        self.timeout = DraftTimeout(timeout_s)
        self.k = k
        self.step = 0
        self._step_sent = 0.0
        self.desynced: set[int] = set()
        self.last_stats: DraftStats | None = None
        self.num_stats = 0  # DraftStats received so far: a waiter compares it with what it saw
        self.last_draft_work_s = 0.0
        self.num_timeouts = 0
        self.num_reconnects = 0
        # Bumped whenever the draft's state can no longer be trusted to match ours.
        self.generation = 0
        self.connected = False
        self.healthy = True
        self._probe_sent = 0.0
        self._pending_releases: set[int] = set()
        self._stash: list[SpecResponse] = []  # responses that arrived during poll_stats
        self.hits_by_depth = [0] * (k + 1)
        # Up = the ZMTP handshake finished (with CURVE, the key check passed too), not
        # merely the transport connected. No ZMQ_IMMEDIATE: with it, a PAIR socket whose
        # peer re-binds after a restart refuses every send (EAGAIN) for good. Sends stay
        # non-blocking, and nothing is sent while the draft is known to be down.
        self._monitor = channel.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        channel.connect(address)

    @property
    def timeout_s(self) -> float:
        return self.timeout.value

    @property
    def alive(self) -> bool:
        return self.connected and self.healthy

    def poll_health(self) -> None:
        """Take socket events; while suspect, probe the draft and listen for any answer."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
                self.connected = True
                self.healthy = True
                self._back()
                if self.generation > 1:
                    self.num_reconnects += 1
                    logger.warning("draft reconnected; re-adding every sequence and resuming speculation")
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                logger.warning("draft disconnected; decoding without speculation until it is back")
        if self.connected and not self.healthy:
            now = time.monotonic()
            if now - self._probe_sent > self.timeout_s:
                self._probe_sent = now
                self._send(DraftStatsRequest())
            while (msg := self._recv(0.0)) is not None:
                if isinstance(msg, DraftStats):
                    self._got_stats(msg)
                    self.healthy = True
                    self._back()
                    logger.warning("draft answers again; re-adding every sequence and resuming speculation")
                    break

    def wait_connected(self, timeout_s: float) -> None:
        """Block until the spec link is up (start-up: Ready is sent only after this, so the
        first request is speculated like every other)."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the draft process did not accept the spec link within {timeout_s:.0f} s")
            self.poll_health()
            time.sleep(0.01)

    def _send(self, msg) -> bool:
        try:
            self.channel.socket.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            if self.healthy:
                logger.warning("draft is not accepting messages; decoding without speculation")
            self.healthy = False
            return False

    def add(self, seq_id: int, token_ids: list[int], temperature: float, top_k: int, top_p: float, seed: int) -> None:
        self._send(
            AddSequence(
                seq_id=seq_id,
                prompt_token_ids=np.asarray(token_ids, dtype=np.int64),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
            )
        )

    def request(self, outcomes: list[Outcome], work_ahead: bool = True) -> None:
        """Send one step's outcomes; work_ahead: whether the draft (SSD) works ahead after answering."""
        if not outcomes:
            return
        self.step += 1
        self._step_sent = time.monotonic()
        self._send(
            SpecRequest(
                step=self.step,
                seq_ids=np.fromiter((o.seq_id for o in outcomes), np.int64, len(outcomes)),
                rounds=np.fromiter((o.round for o in outcomes), np.int64, len(outcomes)),
                num_accepted=np.fromiter((o.num_accepted for o in outcomes), np.int32, len(outcomes)),
                token_ids=np.fromiter((o.token_id for o in outcomes), np.int64, len(outcomes)),
                seq_lens=np.fromiter((o.seq_len for o in outcomes), np.int64, len(outcomes)),
                k=self.k,
                work_ahead=work_ahead,
            )
        )

    def release(self, seq_ids: list[int]) -> None:
        """Free the draft's state of these sequences. A release the draft cannot take now
        is kept and sent when it is back, so a stalled draft does not come back full of
        sequences that finished meanwhile."""
        if not seq_ids:
            return
        if not self.alive or not self._send(Release(seq_ids=np.asarray(seq_ids, dtype=np.int64))):
            self._pending_releases.update(seq_ids)

    def _back(self) -> None:
        self.generation += 1
        if self._pending_releases:
            ids, self._pending_releases = sorted(self._pending_releases), set()
            self.release(ids)

    def request_stats(self) -> None:
        """Ask the draft for fresh counters without waiting for them: the answer is taken
        by `poll_stats` (or by a collect) and bumps `num_stats`."""
        if self.alive:
            self._send(DraftStatsRequest())

    def poll_stats(self) -> None:
        """Take what the draft has sent, without waiting: DraftStats into `last_stats`,
        speculations kept for the next collect."""
        if not self.alive:
            return
        while (msg := self._recv(0.0)) is not None:
            if isinstance(msg, SpecResponse):
                self._stash.append(msg)
            else:
                self._handle_other(msg, {})

    def collect(self, waiting: dict[int, int]) -> dict[int, Speculation]:
        """Wait for the speculations of `waiting` ({seq_id: round}).

        Returns what arrived in time; sequences missing from the result get no
        speculation this round (the caller decodes them plainly and re-syncs them).
        """
        got: dict[int, Speculation] = {}
        if not waiting:
            return got
        for msg in self._stash:
            self._take_response(msg, waiting, got)
        self._stash.clear()
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(waiting):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.connected:
                self.num_timeouts += 1
                self.healthy = False  # suspect until it answers a probe
                # Said once with the fix; later occurrences are counted (num_draft_timeouts).
                log = logger.warning if self.num_timeouts == 1 and self.connected else logger.info
                log("draft did not answer %d of %d sequences within %.2f s; decoding without speculation until it "
                    "answers again%s", len(waiting) - len(got), len(waiting), self.timeout_s,
                    " (a busy machine slows the draft: raise --draft-timeout-s, e.g. 10)"
                    if self.num_timeouts == 1 and self.connected else "")
                break
            msg = self._recv(min(remaining, 0.1))
            if msg is None:
                self.poll_health()  # a disconnect ends the wait at once
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
        why = _inconsistent(msg)
        if why is not None:
            logger.warning("dropping a SpecResponse with inconsistent arrays (%s)", why)
            return
        if msg.step == self.step and self._step_sent:
            self.timeout.observe(time.monotonic() - self._step_sent)
            self._step_sent = 0.0  # one observation per step
        self.last_draft_work_s = msg.draft_work_s
        if all(waiting.get(int(sid)) == int(r) for sid, r in zip(msg.seq_ids, msg.rounds)):
            # Hits of answers nobody waits for (plain steps, stale rounds) are no hits.
            for j, n in enumerate(msg.hits_by_depth[: len(self.hits_by_depth)]):
                self.hits_by_depth[j] += n
        has_q = msg.q_token_ids is not None and msg.q_probs is not None and msg.q_token_ids.size > 0
        cuts = self._vocab_cuts(msg, has_q)  # [B] or None
        for b in range(len(msg.seq_ids)):
            sid = int(msg.seq_ids[b])
            if waiting.get(sid) != int(msg.rounds[b]):
                continue  # stale: a round we stopped waiting for, or a released sequence
            m = int(msg.num_draft_tokens[b])
            if not 0 <= m <= msg.draft_token_ids.shape[1]:
                logger.warning("draft sent num_draft_tokens=%d for seq %d; ignoring it", m, sid)
                self.desynced.add(sid)
                continue
            if cuts is not None and cuts[b] < m:
                cut = int(cuts[b])
                self.num_out_of_vocab += m - cut
                logger.warning("draft proposed token id %d (or a q id out of range) at position %d of seq %d, "
                               "outside the target's vocabulary of %d; it and the %d after it are rejected "
                               "(%d so far)", int(msg.draft_token_ids[b, cut]), cut, sid, self.vocab_size,
                               m - cut - 1, self.num_out_of_vocab)
                m = cut
            got[sid] = Speculation(
                draft_token_ids=msg.draft_token_ids[b, :m].astype(np.int64, copy=False),
                q_token_ids=msg.q_token_ids[b, :m] if has_q else None,
                q_probs=msg.q_probs[b, :m] if has_q else None,
                cache_hit=bool(msg.cache_hit[b]),
            )

    def _vocab_cuts(self, msg: SpecResponse, has_q: bool) -> np.ndarray | None:
        """Per sequence, the position of its first draft id (or q id) outside the target's
        vocabulary, else None when every proposed id is in it (one pass per message).
        Cutting a speculation there keeps verification exact: its length depends on the
        draft's proposal only, and the target samples the cut position itself."""
        if self.vocab_size is None or msg.draft_token_ids.size == 0:
            return None
        ids = msg.draft_token_ids  # [B, K]
        bad = (ids < 0) | (ids >= self.vocab_size)  # [B, K]
        if has_q:
            q = msg.q_token_ids  # [B, K, top_k]
            bad |= ((q < 0) | (q >= self.vocab_size)).any(axis=-1)
        bad &= np.arange(ids.shape[1])[None, :] < np.asarray(msg.num_draft_tokens)[:, None]  # proposed only
        if not bad.any():
            return None
        return np.where(bad.any(axis=1), bad.argmax(axis=1), ids.shape[1])  # [B]

    def _handle_other(self, msg, waiting: dict[int, int]) -> None:
        if isinstance(msg, ErrorReply):
            if msg.seq_id >= 0:
                logger.info("draft could not serve seq %d (%s: %s); it will be re-added", msg.seq_id, msg.code, msg.message)
                self.desynced.add(msg.seq_id)
            else:
                logger.warning("draft error %s: %s", msg.code, msg.message)
        elif isinstance(msg, DraftStats):
            self._got_stats(msg)

    def _got_stats(self, msg: DraftStats) -> None:
        self.last_stats = msg
        self.num_stats += 1

    def _recv(self, timeout_s: float):
        try:
            return self.channel.recv(timeout_s=max(0.0, timeout_s))
        except ProtocolError as e:
            logger.warning("dropping a malformed message from the draft: %s", e)
            return None


def _inconsistent(msg: SpecResponse) -> str | None:
    """Why the arrays of a SpecResponse do not fit together, or None. The codec checks
    each array alone; a peer could still send B seq ids with fewer rounds."""
    b = msg.seq_ids.shape[0] if msg.seq_ids.ndim == 1 else -1
    ids = msg.draft_token_ids
    if b < 0 or ids.ndim != 2 or ids.shape[0] != b:
        return f"seq_ids {msg.seq_ids.shape}, draft_token_ids {ids.shape}"
    for name in ("rounds", "num_draft_tokens", "cache_hit"):
        if getattr(msg, name).shape != (b,):
            return f"{name} {getattr(msg, name).shape} for {b} sequences"
    q_ids, q_probs = msg.q_token_ids, msg.q_probs
    if q_ids is not None and q_ids.size and (q_ids.ndim != 3 or q_ids.shape[:2] != ids.shape
                                             or q_probs is None or q_probs.shape != q_ids.shape):
        return f"q_token_ids {q_ids.shape}, q_probs {None if q_probs is None else q_probs.shape}, draft {ids.shape}"
    return None
