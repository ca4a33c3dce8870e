"""draft_proc main loop: answer SpecRequests, and in SSD mode work ahead between them.

Every message is checked before it touches state. A malformed frame gets an ErrorReply
and the loop goes on; an outcome that does not fit a sequence's state (unknown seq_id,
wrong length, more accepted tokens than were proposed, a token id outside the
vocabulary) gets an ErrorReply for that sequence only, whose state is dropped so the
target re-adds it. The rest of the batch is answered as usual.

SSD: a sequence just added is "fresh" until its first SpecRequest names it. When fresh
sequences exist and no message is waiting, the loop works ahead for all of them in one
batch (SSDEngine.prefetch), so their first outcome can hit the tree cache. A message
always comes first: a sequence whose SpecRequest arrives before that idle moment just
takes the normal path (a miss) and is never prefetched.

KV: with a model draft each sequence holds KV blocks (draft_proc/kv.py), taken when it is
added and as it grows, returned when it is released. A sequence the pool cannot hold
gets an ErrorReply (code "no_kv") and is dropped; the target decodes it without
speculation and re-adds it later.

Counters (DraftStats) are pushed, never waited for: after an answer when the last push is
STATS_PUSH_S old, and when the loop goes idle with counters that changed since. The
target keeps the last ones, so its stats never wait on this process.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from draft_proc.speculator import Speculator
from draft_proc.state import DraftSeq, OutcomeError
from protocol.codec import ProtocolError
from protocol.messages import (
    AddSequence,
    DraftStats,
    DraftStatsRequest,
    ErrorReply,
    Release,
    Shutdown,
    SpecRequest,
    SpecResponse,
)
from protocol.sparse_q import NO_DRAFT, DraftTokens, pack

logger = logging.getLogger(__name__)

# SpecRequest.backup: "" the configured backup, "jit" the same (the round policy names it
# only when the configured one is auto, i.e. jit), "jit:N" a jit chain of N < K tokens,
# "none" no backup for this answer.
BACKUP_CHOICES = ("", "jit", "jit:N", "none")


def backup_len(backup: str, k: int) -> int | None:
    """Tokens the backup drafts for a miss: k for "" and "jit", N for "jit:N" (1 <= N <= k),
    0 for "none"; None for anything else."""
    if backup in ("", "jit"):
        return k
    if backup == "none":
        return 0
    if backup.startswith("jit:") and backup[4:].isdigit() and 1 <= int(backup[4:]) <= k:
        return int(backup[4:])
    return None


def draft_has_own_gpu(cfg) -> bool:
    """Whether the draft runs on a CUDA device none of the target's ranks uses."""
    return cfg.draft_model.device.startswith("cuda") and not cfg.draft_shares_target_gpu


STATS_PUSH_S = 0.5  # the longest the target's copy of the counters lags while answering
SLOW_S = 0.05  # a message (or prefetch) handled in longer is logged at DEBUG, with its time


class DraftWorker:
    def __init__(self, cfg, channel, speculator: Speculator, vocab_size: int, num_slots: int, ssd=None, kv=None,
                 keep_up: bool | None = None):
        """kv: the draft_proc.kv.DraftKV that holds the sequences' KV blocks (a model
        draft); None: the sequences take the num_slots indices only (the n-gram
        speculator, or a drafter over a slot layout). keep_up: compute the KV of a plain
        step's tokens as they come (Speculator.keep_up); default: on a GPU of the draft's
        own, where that work delays no verify."""
        self.cfg = cfg
        self.channel = channel
        self.speculator = speculator
        self.vocab_size = vocab_size
        self.ssd = ssd  # draft_proc.ssd.SSDEngine in SSD mode
        self.kv = kv
        self.free_slots = list(range(num_slots))[::-1]
        self.num_no_kv = 0  # sequences refused or dropped for want of KV blocks
        self.seqs: dict[int, DraftSeq] = {}
        self.num_requests = 0
        self.answer_s = 0.0  # receive to send, summed over num_answers
        self.num_answers = 0
        self.running = True
        # SSD: ids of sequences added but not yet named by a SpecRequest, in arrival order.
        self.fresh: dict[int, None] = {}
        self._worked_ahead = True  # the last SpecRequest's work_ahead flag
        self._last_sd = False  # the last SpecRequest asked for a synchronous SD round
        # The last work-ahead, for TreeBudget: (sequences, work s, end time, whether the
        # next request was already waiting when it ended); None when no work-ahead is
        # the last thing that ran.
        self._last_tree: tuple[int, float, float, bool] | None = None
        self._shapes_named = False  # a SpecRequest named its tree shape
        self._pushed: DraftStats | None = None  # the counters pushed last, and when
        self._pushed_at = 0.0
        self.keep_up = keep_up if keep_up is not None else draft_has_own_gpu(cfg)

    def run_forever(self) -> None:
        while self.running:
            self.run_once()

    def run_once(self, timeout_s: float = 0.5) -> None:
        """Handle the next message; with fresh sequences, do not wait for one: if none is
        waiting, prefetch for them instead."""
        try:
            msg = self.channel.recv(timeout_s=0.0 if self.fresh else timeout_s)
        except ProtocolError as e:
            logger.warning("rejected a malformed message: %s", e)
            self.channel.send_error(e.code, str(e))
            return
        t0 = time.perf_counter()
        if msg is not None:
            self.handle(msg)
        elif self.fresh:
            self.prefetch_fresh()
        else:
            self.push_stats()
            return
        if (took := time.perf_counter() - t0) > SLOW_S and logger.isEnabledFor(logging.DEBUG):
            # A stall of the draft shows in the target as a long wait; this says which message had it.
            logger.debug("handled %s in %.1f ms", "a prefetch" if msg is None else type(msg).__name__, 1e3 * took)

    def prefetch_fresh(self) -> None:
        """One SSD work-ahead over every fresh sequence. A failure is logged and costs only
        hit rate: those sequences miss their first look-up."""
        ids, self.fresh = list(self.fresh), {}
        self._last_tree = None  # a prefetch runs in the window: it measures nothing
        seqs = [self.seqs[sid] for sid in ids if sid in self.seqs]
        if self.ssd is None or not seqs:
            return
        try:
            self.ssd.prefetch(seqs)
        except Exception:
            logger.exception("prefetch for %d new sequences failed; their first look-up will miss", len(seqs))

    def handle(self, msg) -> None:
        if isinstance(msg, SpecRequest):
            self.on_spec_request(msg)
        elif isinstance(msg, AddSequence):
            self.on_add(msg)
        elif isinstance(msg, Release):
            ids = np.asarray(msg.seq_ids)
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                self.channel.send(ErrorReply(code="bad_request", message="Release.seq_ids must be a 1-D integer array"))
                return
            for sid in ids.tolist():
                self.drop(sid)
        elif isinstance(msg, DraftStatsRequest):
            self.channel.send(self.stats())
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, ErrorReply):
            logger.warning("target reported %s: %s", msg.code, msg.message)

    # ---------------------------------------------------------------- messages

    def on_add(self, msg: AddSequence) -> None:
        sid = msg.seq_id
        prompt = np.asarray(msg.prompt_token_ids)
        err = None
        if prompt.ndim != 1 or prompt.size == 0:
            err = "prompt_token_ids must be a non-empty 1-D array"
        elif prompt.min() < 0 or prompt.max() >= self.vocab_size:
            err = f"prompt token ids must be in [0, {self.vocab_size})"
        elif not (math.isfinite(msg.temperature) and msg.temperature >= 0) or not 0 < msg.top_p <= 1 or msg.top_k < 0:
            err = "bad sampling parameters"
        if err is None and sid in self.seqs:
            self.drop(sid)  # a re-add replaces the old state
        if err is None and self.kv is None and not self.free_slots:
            err = f"no free draft slot ({len(self.seqs)} sequences held)"
        if err is not None:
            self.channel.send(ErrorReply(code="bad_request", message=err, seq_id=sid))
            return
        tokens = prompt.astype(np.int64).tolist()
        num_cached = 0
        if self.kv is None:
            slot = self.free_slots.pop()
        else:
            got = self.kv.admit(sid, tokens)
            if isinstance(got, str):
                self._no_kv(sid, got)
                return
            slot, num_cached = got
        seq = DraftSeq(sid, slot, tokens, msg.temperature, msg.top_k, msg.top_p, msg.seed, num_cached=num_cached)
        self.seqs[sid] = seq
        self.speculator.add(seq)
        if self.ssd is not None and self.cfg.spec.ssd_prefetch:
            self.fresh[sid] = None

    def drop(self, sid: int) -> None:
        self.fresh.pop(sid, None)
        seq = self.seqs.pop(sid, None)
        if seq is not None:
            self.speculator.release(seq)
            if self.ssd is not None:
                self.ssd.release(seq)
            if self.kv is None:
                self.free_slots.append(seq.slot)
            else:
                self.kv.free(seq)

    def _no_kv(self, sid: int, why: str) -> None:
        """The pool cannot hold this sequence: the target decodes it without speculation."""
        self.num_no_kv += 1
        log = logger.warning if self.num_no_kv == 1 else logger.debug
        log("draft cannot hold seq %d: %s; it decodes without speculation until blocks free up "
            "(raise the draft's --gpu-memory-utilization, or lower --max-num-seqs)", sid, why)
        self.channel.send(ErrorReply(code="no_kv", message=why, seq_id=sid))

    def on_spec_request(self, req: SpecRequest) -> None:
        t0 = time.perf_counter()
        self._observe_tree_window(t0)
        self.num_requests += 1
        backup_k = backup_len(req.backup, req.k)  # tokens a cache miss gets; None: no such backup
        if not self._well_formed(req, backup_k):
            self.channel.send(ErrorReply(code="bad_request", message=f"SpecRequest arrays must all be integer "
                                         f"[{len(req.seq_ids)}], 1 <= k <= {self.cfg.spec.k}, branches >= 0, backup "
                                         f"one of {BACKUP_CHOICES}, and a request to answer must name each sequence "
                                         "once"))
            return
        # A sequence the draft did not work ahead for has no cache entries: its miss is a
        # synchronous SD round the target chose, not a cache miss.
        counted = self._worked_ahead
        ok = self._apply_outcomes(req)
        if not ok:
            return
        if not req.work_ahead and backup_k == 0:
            self._take_in(ok)
            return
        t1 = time.perf_counter()
        if self.ssd is not None:
            # Right after an SD round no tree stands behind this answer: a round that
            # speculates gets chains, as SD rounds do, whatever it names for cache misses.
            specs, hits_by_depth = self.ssd.propose(ok, req.k, count_misses=counted,
                                                    backup_k=req.k if self._last_sd and req.work_ahead else backup_k)
        elif backup_k == 0:  # no backup asked of a draft without a tree cache: no drafts
            for s in ok:
                s.set_no_speculation()
            specs, hits_by_depth = [NO_DRAFT] * len(ok), []
        else:
            specs, hits_by_depth = self.speculator.propose(ok, req.k), []
        t2 = time.perf_counter()
        self.channel.send(self._response(req.step, req.k, ok, specs, hits_by_depth))
        self._commit(ok)
        t3 = time.perf_counter()
        self.answer_s += t3 - t0
        self.num_answers += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("answer step %d: %d seqs, %d hits; outcomes %.2f ms, drafts %.2f ms, send %.2f ms",
                         req.step, len(ok), sum(bool(s.cache_hit) for s in specs), 1e3 * (t1 - t0),
                         1e3 * (t2 - t1), 1e3 * (t3 - t2))
        self._push_stats_due()
        if self.ssd is not None:
            self._worked_ahead = bool(req.work_ahead)
            self._last_sd = not req.work_ahead and backup_k != 0
            if req.work_ahead:
                # Answer first, then work ahead for the outcomes expected next round.
                self.ssd.work_ahead(ok, req.k, branches=req.branches)
                # Once the target names shapes (its round policy), TreeBudget only follows them.
                self._shapes_named |= req.branches > 0
                if not self._shapes_named:
                    self._last_tree = (len(ok), self.ssd.last_work_s, time.perf_counter(), self.channel.pending())
            else:
                # The next round is synchronous SD: entries for this round's outcomes
                # would answer a speculation that is no longer outstanding.
                self.ssd.skip_work_ahead(ok)

    def _well_formed(self, req: SpecRequest, backup_k: int | None) -> bool:
        """Whether a SpecRequest's fields fit together. Integer arrays only (a float array
        could carry NaN, which int() refuses); a sequence named twice only where no answer
        is asked for (the outcomes of several plain steps, in order)."""
        b = len(req.seq_ids)
        arrays = (req.seq_ids, req.rounds, req.num_accepted, req.token_ids, req.seq_lens)
        if any(np.asarray(a).shape != (b,) or not np.issubdtype(np.asarray(a).dtype, np.integer) for a in arrays):
            return False
        if not 1 <= req.k <= self.cfg.spec.k or req.branches < 0 or backup_k is None:
            return False
        return not (req.work_ahead or backup_k) or len(set(np.asarray(req.seq_ids).tolist())) == b

    def _take_in(self, seqs: list[DraftSeq]) -> None:
        """A plain step's outcomes (no work-ahead, no backup): the target waits for no
        answer, so none is drafted or sent; the sequences' state has moved on (and, with
        keep_up, their KV with it). It may hold several steps: a sequence's rows in order."""
        seqs = list({s.seq_id: s for s in seqs}.values())
        if self.ssd is not None:
            self.ssd.take_in(seqs)
            self._worked_ahead = self._last_sd = False
        if self.keep_up:
            self.speculator.keep_up(seqs)
        self._commit(seqs)
        self._push_stats_due()

    def _commit(self, seqs: list[DraftSeq]) -> None:
        if self.kv is not None:
            for seq in seqs:  # their confirmed tokens' K/V is final now: name the full blocks
                self.kv.commit(seq)

    def _push_stats_due(self) -> None:
        if time.monotonic() - self._pushed_at >= STATS_PUSH_S:
            self.push_stats()

    def _apply_outcomes(self, req: SpecRequest) -> list[DraftSeq]:
        """Apply each sequence's outcome (j, t) of the target's last round; a sequence whose
        outcome does not fit its state gets a desync error and is dropped."""
        # Their state moves on now: a prefetch would work ahead from a stale state.
        for sid in np.asarray(req.seq_ids).tolist():
            self.fresh.pop(sid, None)
        ok: list[DraftSeq] = []
        for i in range(len(req.seq_ids)):
            sid = int(req.seq_ids[i])
            seq = self.seqs.get(sid)
            token = int(req.token_ids[i])
            try:
                if seq is None:
                    raise OutcomeError(f"unknown seq_id {sid}")
                if not 0 <= token < self.vocab_size:
                    raise OutcomeError(f"token id {token} is outside [0, {self.vocab_size})")
                if self.ssd is not None:
                    self.ssd.note_outcome(seq, int(req.num_accepted[i]), token)
                seq.apply_outcome(int(req.num_accepted[i]), token, int(req.seq_lens[i]), int(req.rounds[i]))
            except OutcomeError as e:
                self.channel.send(ErrorReply(code="desync", message=str(e), seq_id=sid))
                self.drop(sid)
                continue
            if self.kv is not None:
                if not self.kv.grow(seq):
                    self.drop(sid)
                    self._no_kv(sid, f"no free draft KV blocks to grow to {seq.num_tokens} tokens")
                    continue
            ok.append(seq)
        return ok

    def _observe_tree_window(self, now: float) -> None:
        """Tell TreeBudget how the last work-ahead fit the target's verify: the wait for
        this request after it ended (zero if the request was already waiting)."""
        last, self._last_tree = self._last_tree, None
        if last is None or self.ssd is None:
            return
        n, work_s, ended, overran = last
        self.ssd.budget.observe(n, work_s, 0.0 if overran else now - ended)

    def _response(self, step: int, k: int, seqs: list[DraftSeq], specs: list[DraftTokens],
                  hits_by_depth) -> SpecResponse:
        # q travels when any sequence samples; a greedy row among them gets a one-hot q.
        draft_ids, num_draft, q_ids, q_probs = pack(specs, k, with_q=any(s.temperature > 0 for s in seqs))
        return SpecResponse(
            step=step,
            seq_ids=np.fromiter((s.seq_id for s in seqs), np.int64, len(seqs)),
            rounds=np.fromiter((s.round for s in seqs), np.int64, len(seqs)),
            draft_token_ids=draft_ids,
            num_draft_tokens=num_draft,
            cache_hit=np.fromiter((s.cache_hit for s in specs), bool, len(specs)),
            hit_rank=np.fromiter((s.hit_rank for s in specs), np.int32, len(specs)),
            q_token_ids=q_ids,
            q_probs=q_probs,
            draft_work_s=self.ssd.last_work_s if self.ssd is not None else 0.0,
            hits_by_depth=list(hits_by_depth),
        )

    def push_stats(self) -> None:
        """Send the counters to the target if they changed since the last push. Never
        blocks: a target that is not reading misses this push, not the next."""
        st = self.stats()
        self._pushed_at = time.monotonic()
        if st == self._pushed:
            return
        if self.channel.try_send(st):
            self._pushed = st

    def stats(self) -> DraftStats:
        return DraftStats(
            num_seqs=len(self.seqs),
            num_cache_entries=self.ssd.num_entries() if self.ssd is not None else 0,
            num_requests=self.num_requests,
            num_hits=self.ssd.num_hits if self.ssd is not None else 0,
            num_misses=self.ssd.num_misses if self.ssd is not None else 0,
            answer_s=self.answer_s,
            num_answers=self.num_answers,
            num_tree_shrinks=self.ssd.budget.num_shrinks if self.ssd is not None else 0,
            num_tree_grows=self.ssd.budget.num_grows if self.ssd is not None else 0,
            num_kv_blocks=self.kv.blocks.num_blocks if self.kv is not None else 0,
            num_free_kv_blocks=self.kv.num_free_blocks if self.kv is not None else 0,
            prefix_cache_queries=self.kv.counters()[0] if self.kv is not None else 0,
            prefix_cache_hits=self.kv.counters()[1] if self.kv is not None else 0,
        )
