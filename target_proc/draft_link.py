"""target_proc's end of the spec link: what the draft knows of each sequence, and the messages.

DraftLink owns the draft-sync state of every sequence: whether the draft's view of it is
current (`synced`), the round whose speculation is awaited, and the sequences the draft
reported it could not serve. The worker speaks in steps (admit, collect, send outcomes,
finish) and never reads that state; `NoDraft` is the same interface without a draft.

The draft is a helper, never a dependency:
  - a speculation that does not arrive within the draft timeout is not waited for (that
    round verifies nothing, which is plain decoding), and the draft is then *suspect*:
    no round waits on it again until it answers a probe (a stalled draft costs one
    timeout, not one per round);
  - a dead draft is noticed from the socket itself, and sends never block
    (target_proc.draft_socket);
  - a response for a round we no longer wait for is stale and dropped;
  - a draft token id outside the target's vocabulary can never be accepted: the
    speculation is cut before it (a shorter speculation is still exact) and logged;
  - whenever the draft comes back (reconnected after a restart, or answering again
    after a stall) `generation` grows, and every sequence is re-added before it is
    speculated again;
  - the draft pushes its counters (DraftStats) on its own; the link keeps the last ones,
    so reading them never waits on the draft.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from protocol.messages import AddSequence, DraftStats, ErrorReply, Release, SpecResponse
from protocol.sparse_q import NO_DRAFT, DraftTokens
from target_proc.draft_socket import DraftSocket
from target_proc.outputs import draft_fields
from target_proc.sequence import Sequence
from target_proc.speculation import Outcome, answered, awaited_rows, inconsistent, response_rows, spec_request

logger = logging.getLogger(__name__)

DRAIN_EVERY_S = 0.1  # how often an idle or plain-decoding loop takes what the draft sent


class DraftLink(DraftSocket):
    def __init__(self, channel, address: str, timeout_s: float | None, k: int, vocab_size: int | None = None):
        """channel, address, timeout_s: as DraftSocket's. vocab_size: the target's; draft
        token ids outside [0, vocab_size) are treated as rejected."""
        super().__init__(channel, address, timeout_s)
        self.vocab_size = vocab_size
        self.num_out_of_vocab = 0  # draft tokens cut because the target has no such id
        self.k = k
        self.step = 0
        self._step_sent = 0.0
        # Per-sequence sync state. synced: the draft's view of the sequence is current;
        # rounds: the round whose speculation is awaited (a response for another is stale);
        # desynced: the draft said it cannot serve the sequence, so it is re-added;
        # unanswered: its last outcome came from a plain step, which the draft does not answer.
        self.synced: set[int] = set()
        self.rounds: dict[int, int] = {}
        self.desynced: set[int] = set()
        self.unanswered: set[int] = set()
        self.last_draft_work_s = 0.0
        self.num_timeouts = 0
        self._seen_generation = 0
        self._drained = 0.0
        self._pending_releases: set[int] = set()
        self._stash: list[SpecResponse] = []  # responses taken outside a collect
        self.hits_by_depth = [0] * (k + 1)
        # Plain steps' outcomes not sent yet (_hold), and how many steps they came from.
        self._held: list[tuple] = []  # Outcome fields
        self._held_steps = 0
        # At most K held steps: the draft then feeds each sequence's held tokens in one
        # forward of at most K + 1 tokens, a shape its graphs hold (Speculator.keep_up).
        self.hold_steps = max(1, k)

    present = True  # there is a draft (NoDraft says False)

    def add(self, seq: Sequence, token_ids: list[int]) -> None:
        """The draft prefills token_ids; its next outcome carries the token after them."""
        sp = seq.sampling
        self._send(AddSequence(seq_id=seq.seq_id, prompt_token_ids=np.asarray(token_ids, dtype=np.int64),
                               temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seq.seed))
        self.synced.add(seq.seq_id)

    def request(self, outcomes: list[Outcome], work_ahead: bool = True, branches: int = 0, backup: str = "") -> None:
        """Send one step's outcomes; work_ahead: whether the draft (SSD) works ahead after
        answering, with `branches` per sequence (0: its own choice); backup: what answers
        this request's misses ("": the configured backup). Neither (a plain step): the draft
        takes the outcomes in and answers nothing."""
        if not outcomes:
            return
        wanted = answered(work_ahead, backup)
        if wanted:
            self._flush_held()  # the draft applies them first, in order
        self.step += 1
        self._step_sent = time.monotonic() if wanted else 0.0
        self._send(spec_request(self.step, outcomes, self.k, work_ahead, branches, backup))

    def release(self, seq_ids: list[int]) -> None:
        """Free the draft's state of these sequences. A release the draft cannot take now
        is kept and sent when it is back, so a stalled draft does not come back full of
        sequences that finished meanwhile."""
        if not seq_ids:
            return
        if self._held:  # the draft forgets the sequences: their held outcomes are moot
            gone = set(seq_ids)
            self._held = [o for o in self._held if o[0] not in gone]  # o[0]: the seq_id
        if not self.alive or not self._send(Release(seq_ids=np.asarray(seq_ids, dtype=np.int64))):
            self._pending_releases.update(seq_ids)

    def _back(self) -> None:
        super()._back()
        if self._pending_releases:
            ids, self._pending_releases = sorted(self._pending_releases), set()
            self.release(ids)

    # ---------------------------------------------------------------- the worker's steps

    def check(self) -> None:
        """Once per loop: take socket events and probe a suspect draft; a draft that came
        back (restarted, or answering after a stall) knows nothing current, so every
        sequence is re-added before it is speculated again. Every DRAIN_EVERY_S, also
        take what the draft sent (its pushed counters) without waiting."""
        self.poll_health()
        if self.generation != self._seen_generation:
            self._seen_generation = self.generation
            self.synced.clear()
            self.unanswered.clear()
            self._held, self._held_steps = [], 0  # every sequence is re-added
        now = time.monotonic()
        if now - self._drained >= DRAIN_EVERY_S:
            self._drained = now
            self._drain()

    def admit(self, seqs: list[Sequence]) -> None:
        """Add new sequences before the target prefills them: the draft prefills (and, in
        SSD mode, works ahead for the first outcome) meanwhile."""
        if not self.alive:
            return
        for seq in seqs:
            if not seq.will_finish(1):
                self.add(seq, seq.token_ids)

    def send_first_tokens(self, seqs: list[Sequence]) -> None:
        """After prefill: the first outcome (0, first token) of each added sequence still running."""
        self.request([self._outcome(s.seq_id, 0, s.last_token_id, s.num_tokens) for s in seqs
                      if s.seq_id in self.synced])

    def collect(self, seqs: list[Sequence]) -> dict[int, DraftTokens]:
        """This round's speculations of `seqs`, as many as arrive in time. Sequences whose
        draft state may be stale are re-added first, with their last outcome, and awaited
        like the rest; one left without an answer decodes plainly and is re-added next round.
        A sequence whose last step was plain was not answered: it verifies nothing, at once."""
        if not self.alive:
            self.synced.difference_update(s.seq_id for s in seqs)
            return {}
        self._resync([s for s in seqs if s.seq_id not in self.synced or s.seq_id in self.desynced])
        waiting = {s.seq_id: self.rounds.get(s.seq_id, 0) for s in seqs
                   if s.seq_id in self.synced and s.seq_id not in self.unanswered}
        specs = self.wait_speculations(waiting)
        for sid in waiting:
            if sid not in specs:
                self.synced.discard(sid)
                self._next_round(sid)
        for s in seqs:
            if s.seq_id in self.unanswered and s.seq_id in self.synced:
                specs[s.seq_id] = NO_DRAFT
        return specs

    def send_outcomes(self, seqs: list[Sequence], specs: dict[int, DraftTokens], num_accepted: list[int],
                      token_ids: list[list[int]], speculated: bool, choose_work_ahead: Callable[[int], Any]) -> Any:
        """Tell the draft each sequence's outcome (j, t) of this step, before the host
        post-processes it. A plain step (speculated False) still gives the draft the outcome
        of every synced sequence, as (0, t); a plan with no work-ahead and backup "none" (a
        plain step's) asks for no answer, so its outcomes wait for the next request (_hold),
        and those sequences are `unanswered` until their next outcome. choose_work_ahead(
        number of outcomes) gives the request's work_ahead flag, or a plan
        (target_proc.round_policy.RoundPlan) with its tree shape and backup too; returns it
        (True when nothing was sent)."""
        if not self.alive:
            return True
        outcomes, rounds, synced, desynced = [], self.rounds, self.synced, self.desynced
        for seq, j, toks in zip(seqs, num_accepted, token_ids):  # a plain step's host time: inlined
            sid = seq.seq_id
            if (sid in specs or (not speculated and sid in synced)) and sid not in desynced:
                n = len(seq.token_ids) + j + 1
                if n - seq.num_prompt_tokens < seq.sampling.max_tokens:  # not seq.will_finish(j + 1)
                    rounds[sid] = r = rounds.get(sid, 0) + 1
                    outcomes.append((sid, r, j, toks[j], n))  # an Outcome's fields
        choice = choose_work_ahead(len(outcomes))
        if isinstance(choice, bool):
            work_ahead, branches, backup = choice, 0, ""
        else:
            work_ahead, branches, backup = choice.work_ahead, choice.branches, choice.backup
        if answered(work_ahead, backup):
            self.request(outcomes, work_ahead=work_ahead, branches=branches, backup=backup)
            self.unanswered.difference_update(o[0] for o in outcomes)
        else:
            self._hold(outcomes)
            self.unanswered.update(o[0] for o in outcomes)
        return choice

    def _hold(self, outcomes: list[Outcome]) -> None:
        """A plain step's outcomes wait: one request carries those of hold_steps plain steps
        (each sequence's in order), or of fewer when a request that asks for an answer
        comes first (sent just before it). A message per plain step cost the target 0.13 to
        0.22 ms of host time per step on H100 hosts (docs/benchmarks.md), 2% of a step."""
        self._held += outcomes
        self._held_steps += 1
        if self._held_steps >= self.hold_steps:
            self._flush_held()

    def _flush_held(self) -> None:
        held, self._held, self._held_steps = self._held, [], 0
        if held:
            self.request(held, work_ahead=False, backup="none")

    def finish(self, seq_id: int) -> None:
        """Forget a finished sequence; the draft frees it too (also when unsynced: the
        draft may still hold an older state of it)."""
        self.release([seq_id])
        self.synced.discard(seq_id)
        self.rounds.pop(seq_id, None)
        self.desynced.discard(seq_id)
        self.unanswered.discard(seq_id)

    def preempt(self, seq_id: int) -> None:
        """Forget a preempted sequence's draft state; it is re-added, like any unsynced
        sequence, when it runs again. Its round count stays, so answers to its earlier
        rounds are dropped as stale."""
        self.release([seq_id])
        self.synced.discard(seq_id)
        self.desynced.discard(seq_id)
        self.unanswered.discard(seq_id)

    def take_draft_work_s(self) -> float:
        """Seconds the draft reported working ahead since the last call (SSD)."""
        work_s, self.last_draft_work_s = self.last_draft_work_s, 0.0
        return work_s

    def engine_fields(self) -> dict:
        """The draft's part of EngineStats, from the counters it pushed last."""
        return draft_fields(self.last_stats, alive=self.alive, hits_by_depth=self.hits_by_depth,
                            num_timeouts=self.num_timeouts, timeout_s=self.timeout_s)

    # ---------------------------------------------------------------- sync internals

    def _next_round(self, seq_id: int) -> int:
        self.rounds[seq_id] = self.rounds.get(seq_id, 0) + 1
        return self.rounds[seq_id]

    def _outcome(self, seq_id: int, num_accepted: int, token_id: int, seq_len: int) -> Outcome:
        return Outcome(seq_id, self._next_round(seq_id), num_accepted, token_id, seq_len)

    def _resync(self, seqs: list[Sequence]) -> None:
        """Re-add sequences whose draft state may be stale, with the outcome (0, last token)."""
        if not seqs:
            return
        self.release([s.seq_id for s in seqs])
        outcomes = []
        for seq in seqs:
            self.desynced.discard(seq.seq_id)
            self.unanswered.discard(seq.seq_id)
            self.add(seq, seq.token_ids[:-1])
            outcomes.append(self._outcome(seq.seq_id, 0, seq.last_token_id, seq.num_tokens))
        self.request(outcomes)

    def _drain(self) -> None:
        """Take what the draft has sent, without waiting: DraftStats into `last_stats`,
        answers to a sequence's latest round kept, in order, for the next collects."""
        if not self.alive:
            return
        while (msg := self._recv(0.0)) is not None:
            if isinstance(msg, SpecResponse):
                self._observe_answer(msg)
                self._stash.append(msg)
            else:
                self._handle_other(msg)
        self._stash = [m for m in self._stash if any(self.rounds.get(sid) == r for sid, r in response_rows(m))]

    # ---------------------------------------------------------------- waiting

    def wait_speculations(self, waiting: dict[int, int]) -> dict[int, DraftTokens]:
        """Wait for the speculations of `waiting` ({seq_id: round}).

        Returns what arrived in time; sequences missing from the result get no
        speculation this round (the caller decodes them plainly and re-syncs them). An answer
        to a sequence not awaited now (the other half, in halves steps) waits for its collect.
        """
        got: dict[int, DraftTokens] = {}
        if not waiting:
            return got
        stash, self._stash = self._stash, []
        for msg in stash:
            self._take_response(msg, waiting, got)
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
                self._observe_answer(msg)
                self._take_response(msg, waiting, got)
            else:
                self._handle_other(msg)
                # A desync error for a sequence we wait for: it will not be answered.
                for sid in list(waiting):
                    if sid in self.desynced and sid not in got:
                        waiting = {s: r for s, r in waiting.items() if s != sid}
        return got

    def _take_response(self, msg: SpecResponse, waiting: dict[int, int], got: dict[int, DraftTokens]) -> None:
        """Take the rows that answer `waiting`; keep `msg` if it answers another's latest round."""
        why = inconsistent(msg)
        if why is not None:
            logger.warning("dropping a SpecResponse with inconsistent arrays (%s)", why)
            return
        pairs = response_rows(msg)
        if any(sid not in waiting and self.rounds.get(sid) == r for sid, r in pairs):
            self._stash.append(msg)
        if not any(waiting.get(sid) == r for sid, r in pairs):
            return
        self.last_draft_work_s = msg.draft_work_s
        if all(waiting.get(sid) == r for sid, r in pairs):
            # Hits of answers nobody waits for (plain steps, stale rounds) are no hits.
            for j, n in enumerate(msg.hits_by_depth[: len(self.hits_by_depth)]):
                self.hits_by_depth[j] += n
        for b, sid, spec, num_cut in awaited_rows(msg, waiting, self.vocab_size):
            if spec is None:
                logger.warning("draft sent num_draft_tokens=%d for seq %d; ignoring it", msg.num_draft_tokens[b], sid)
                self.desynced.add(sid)
                continue
            if num_cut:
                cut = len(spec.draft_token_ids)
                self.num_out_of_vocab += num_cut
                logger.warning("draft proposed token id %d (or a q id out of range) at position %d of seq %d, "
                               "outside the target's vocabulary of %d; it and the %d after it are rejected "
                               "(%d so far)", int(msg.draft_token_ids[b, cut]), cut, sid, self.vocab_size,
                               num_cut - 1, self.num_out_of_vocab)
            got[sid] = spec

    def _observe_answer(self, msg: SpecResponse) -> None:
        """The answer time of the last request feeds the measured timeout, once per step."""
        if msg.step == self.step and self._step_sent:
            self.timeout.observe(time.monotonic() - self._step_sent)
            self._step_sent = 0.0

    def _handle_other(self, msg) -> None:
        if isinstance(msg, ErrorReply):
            if msg.seq_id >= 0:
                logger.info("draft could not serve seq %d (%s: %s); it will be re-added", msg.seq_id, msg.code, msg.message)
                self.desynced.add(msg.seq_id)
            else:
                logger.warning("draft error %s: %s", msg.code, msg.message)
        elif isinstance(msg, DraftStats):
            self.last_stats = msg
