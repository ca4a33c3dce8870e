"""How each SSD-mode step runs, per batch size and context length, chosen from measured costs.

Per bucket of batch size and context length (each a power of two; contexts below 1024
tokens share one bucket) the options are:
  - an SSD round at a tree shape n (branches per sequence, a level of
    SpeculativeConfig.tree_levels) with a miss backup: jit (a K-token chain drafted on
    request), from batch 2 also a short jit (K/4 tokens: `jit:N`) or none;
  - a synchronous SD round: the draft answers with a chain drafted on request and does
    not work ahead (as `--mode sd`);
  - from batch 8, SD rounds over halves of the batch in turn (`halves`): a step verifies
    one half while the draft chains the other, whose outcome the step before gave it;
  - plain decoding: no speculation.
Every option yields the target's distribution exactly; they differ only in speed, so the
policy predicts each one's tokens/s (target_proc/round_model.py; once an option has run,
its realized rate stands in) and runs the fastest.

How it chooses: the largest tree first, until it is measured (from batch 4 with backup none, below with jit:
round_model.first_option); then one probe of SD rounds (measures c), unless buckets of fewer sequences and no longer
contexts measured c: the largest of theirs stands in, a floor (a chain over more rows or a longer context takes no
less), and an option that needs c runs only where it wins at that; till then a step that measures nothing (a filling
batch) is plain, and until the batch size has stood SETTLE_STEPS steps the bucket runs what the bucket it came from
chose, unless that was an SSD round (halves as SD rounds where halves are not an option): a drain passes each bucket in
a few steps, too few for the first measurements to pay. A bucket the batch enters as its context doubles (or halves)
starts from the costs and choice of the one it leaves: they change little with the context, and measuring every option
afresh cost 50-140 ms of speculating steps per bucket at alpha 0.6 (docs/benchmarks.md). Then each step runs the best
prediction (halves, unmeasured, rated from half the batch's bucket: H's estimate in round_model). An option whose
inputs are not measured yet is probed before it is run: the next smaller tree when the best one overruns the verify;
plain decoding once its estimate with P taken as S comes within PLAIN_PRIOR_SLACK of the best, a floor: a plain step
verifies one token per sequence, a speculating one K + 1. Every `probe_every` steps another option is probed for
`probe_len` steps so its measurements stay current: first the choice last switched away from (a few slow steps of the
host may have caused the switch, and its stale rate would keep it), then the one the model predicts fastest when that
beats the choice's realized rate (a realized rate from a few steps of a transition must not rule an option out), else
the runner-up (every fourth probe goes to the other options in turn), whose turn is skipped every other time while it
rates more than CLOSE below the choice. A probe discards the option's earlier realized rate; one that loses by less
than CLOSE runs on until it has a full window (8 steps), as a few steps of SSD at small batch scatter too widely to
decide between options this close. A probe's steps wait for steps that can measure (the choice runs meanwhile), and a
probe whose bucket the batch left is dropped: its first three steps back measure nothing. A probe costs its steps and
two switches, so one after which the choice stands (or one skipped) doubles the wait for the next (up to 8 x
probe_every steps); a change of choice restores it. A choice that stood RANK_EVERY rankings in a row is ranked once in
RANK_EVERY steps, then twice as far apart at each ranking that keeps it, up to MAX_HOLD steps: ranking every option is
most of the policy's host time. A step measures an option only when the two requests before it named it (its wait
answers the request one back, from the cache built after the request two back; a plain step queued ahead may name the
next step's plan, target_proc/ahead.py), and no sequence of the batch is in its first STEADY_AFTER_ROUNDS rounds. A
realized rate also needs the request three back: the first chain after SSD rounds feeds the draft the last hit's branch
(its KV is in the tree's scratch rows), a switch's cost. Where no request waits, the batch drains: a step runs plain
instead of the choice where the spread the choice adds between the sequences makes it MARGIN slower than plain steps
(target_proc/drain.py) or no sequence has two tokens to go, a step after a plain one stays plain with fewer tokens left
than warmup + 3 (the first rounds after a switch find no tree: they would not pay), and a periodic probe starts only
with DRAIN_PROBE_LEFT times its wait in tokens left (its switches and spread cost more than a short rest of the batch
returns; alone, a sequence adds no spread: its wait). `jit` is the only backup at batch 1; from 2 one miss holds up the
batch: jit:N and none too.

A draft on one of the target's GPUs gets no SSD rounds (unless SD rounds are ruled out): its work-ahead would
compete with the verify for the same GPU (docs/benchmarks.md measures it). Overrides pin what they name:
--tree-shape fixed, --fan-out or --tree-budget (one tree shape), --backup, --work-ahead always (no SD rounds)
or halves (halves only), --spec-policy always (no plain steps). Pure bookkeeping, no torch.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from target_proc.drain import drained_rate
from target_proc.round_model import (  # noqa: F401 - re-exported
    HALVES, MIN_SAMPLES as _MIN_SAMPLES, MARGIN as _MARGIN, PLAIN, SD, WINDOW, Costs, RoundPlan,
    chain_tokens, first_option, halves_estimate, model_rate, predict, running_mean as _mean, short_jit_len,
    unmeasured_alternative,
)
from target_proc.spec_policy import batch_bucket

logger = logging.getLogger(__name__)

JIT_ONLY_BELOW = 2  # batch sizes below this always use the jit backup
HALVES_FROM_BATCH = 8  # batch sizes from which SD rounds over halves are an option
SHORT_JIT_DIV = 4  # the short jit drafts K // 4 tokens (none below K = 4)
MAX_PROBE_BACKOFF = 8  # probes that change nothing space out up to this many times probe_every
CLOSE = 0.1  # a probe that comes this close to the choice runs on until its realized window is full
MIN_CONTEXT_BUCKET = 1024  # contexts below this share one bucket of costs
STEADY_AFTER_ROUNDS = 3  # a sequence's rounds (its prefill included) before its steps measure costs
RANK_EVERY = 4  # a choice that stood this many rankings in a row is ranked once in this many steps
MAX_HOLD = 32  # ... then twice as far apart per ranking that keeps it, up to this many steps
SETTLE_STEPS = 16  # steps at one batch size before a bucket runs its first measurements (if another chose)
DRAIN_PROBE_LEFT = 4  # a draining batch starts a periodic probe only with this many times its wait in tokens left


@dataclass
class _Bucket:
    costs: Costs = field(default_factory=Costs)
    choice: RoundPlan | None = None
    probe: deque = field(default_factory=deque)  # plans still to run in a probe
    steps_since_probe: int = 0
    num_probes: int = 0
    probed: RoundPlan | None = None  # the option of the periodic probe under way
    extended: bool = False  # the probe under way has run on (CLOSE)
    backoff: int = 1  # the next periodic probe comes after probe_every * backoff steps
    stood: int = 0  # rankings in a row that kept the choice (none since a probe)
    hold: int = 0  # steps the choice runs before the options are ranked again
    left: RoundPlan | None = None  # the choice before the last switch, until a periodic probe runs it
    skipped: bool = False  # the last periodic probe was skipped (_periodic_probe)


class RoundPolicy:
    """Per batch-size bucket, the plan of each step; see the module doc."""

    def __init__(self, tree_levels, *, allow_ssd: bool = True, allow_sd: bool = True, allow_plain: bool = True,
                 allow_halves: bool = True, backup_auto: bool = True, probe_every: int = 64, probe_len: int = 4,
                 warmup: int = 4, k: int = 0, short_jit: int = 0):
        """tree_levels(batch) -> the tree shapes SSD may run, largest first (one: pinned, left to the draft as 0).
        backup_auto: choose each round's backup (jit; from batch 2 also none and `jit:short_jit` if short_jit > 0),
        else the configured one; k: the speculation length; allow_halves: from HALVES_FROM_BATCH (any if alone)."""
        if probe_every < 2 or probe_len < 1 or warmup < 1:
            raise ValueError("need probe_every >= 2, probe_len >= 1 and warmup >= 1")
        if short_jit < 0 or (short_jit and not 0 < short_jit < k):
            raise ValueError(f"short_jit must be 0 or in [1, k), got {short_jit} with k={k}")
        self.k, self.short_jit, self.tree_levels, self.allow_ssd = k, short_jit, tree_levels, allow_ssd
        self.allow_sd, self.allow_plain, self.allow_halves = allow_sd, allow_plain, allow_halves
        self.backup_auto, self.probe_every, self.probe_len, self.warmup = backup_auto, probe_every, probe_len, warmup
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._options: dict[int, list[RoundPlan]] = {}  # per batch size (tree_levels is fixed)
        self._current: dict[int, tuple[int, int]] = {}  # batch bucket -> the key of its last step
        self._history: deque = deque([(0, None)] * 3, maxlen=3)  # (bucket, plan) of the last three steps
        self._visit: tuple = ((0, 0), 0, 0, None)  # the last step's bucket and batch, steps at it, what came before
        self._last: RoundPlan | None = None  # the last step's plan
        # Steps per plan kind, changes of a bucket's choice, time spent in choose and record_step (the worker's calls).
        self.steps, self.num_switches, self.host_s = Counter(), 0, 0.0

    @classmethod
    def for_config(cls, cfg) -> "RoundPolicy":
        spec = cfg.spec
        if spec.work_ahead == "halves":
            return cls(spec.tree_levels, allow_ssd=False, allow_sd=False, allow_plain=False, allow_halves=True,
                       probe_every=cfg.sched.spec_policy_probe_every, k=spec.k)
        allow_sd, allow_ssd = spec.work_ahead == "auto" and spec.backup != "none", cfg.ssd_rounds_possible
        if not allow_ssd:
            logger.info("the draft shares the target's GPU (%s): no SSD rounds (nor trees prefetched for new "
                        "sequences), whose work-ahead would compete with the verify for it; SD rounds or plain steps "
                        "by measured costs (--work-ahead always runs SSD rounds anyway)", cfg.draft.device)
        # Halves make the draft chain while the target verifies: not on the target's GPU.
        return cls(spec.tree_levels, allow_ssd=allow_ssd, allow_sd=allow_sd, backup_auto=spec.backup == "auto",
                   allow_plain=cfg.sched.spec_policy == "adaptive", allow_halves=allow_sd and allow_ssd,
                   probe_every=cfg.sched.spec_policy_probe_every, k=spec.k, short_jit=spec.k // SHORT_JIT_DIV)

    @staticmethod
    def key(batch: int, context: int) -> tuple[int, int]:
        """The bucket of `batch` sequences of `context` tokens on average (costs grow with the context)."""
        return batch_bucket(batch), max(MIN_CONTEXT_BUCKET, batch_bucket(context))

    def shapes(self, batch: int) -> list[int]:
        """The tree shapes of this batch size's SSD options, largest first (one pinned: [0])."""
        return levels if len(levels := self.tree_levels(batch)) > 1 else [0]

    def options(self, batch: int) -> list[RoundPlan]:
        """Every plan allowed at this batch size: SSD shapes (largest first) x backups, SD, halves, plain."""
        if (cached := self._options.get(batch)) is not None:
            return cached
        shapes = self.shapes(batch)
        short = [f"jit:{self.short_jit}"] if self.short_jit else []
        auto = ["jit", *short, "none"] if batch >= JIT_ONLY_BELOW else ["jit"]
        backups = auto if self.backup_auto else [""]
        out = [RoundPlan("ssd", n, b) for b in backups for n in shapes] if self.allow_ssd else []
        halves = self.allow_halves and (batch >= HALVES_FROM_BATCH or not (self.allow_ssd or self.allow_sd))
        self._options[batch] = out = out + [SD] * self.allow_sd + [HALVES] * halves + [PLAIN] * self.allow_plain
        return out

    # ---------------------------------------------------------------- choosing

    def choose(self, batch: int, context: int = 0, steady: bool = True, drain: tuple | None = None) -> RoundPlan:
        """The plan of a step over `batch` sequences of `context` tokens on average; steady: as `record`'s; drain:
        (left, spread) of their remaining tokens where no request waits (drain.batch_drain), else None."""
        t0 = time.perf_counter()
        plan = self._last = self._choose(batch, context, steady, drain)
        self.host_s += time.perf_counter() - t0
        self.steps[plan.kind] += 1
        return plan

    def _choose(self, batch: int, context: int, steady: bool, drain) -> RoundPlan:
        key = self.key(batch, context)
        came_from, self._current[key[0]] = self._current.get(key[0]), key
        b = self._bucket(key, came_from)
        last, last_batch, steps, came = self._visit
        prev = self._buckets.get(last)
        # A bucket left before it chose passes on what the one before it chose.
        came = came if key == last or prev is None or prev.choice is None else prev.choice
        self._visit, opts = (key, batch, steps + 1 if batch == last_batch else 0, came), self.options(batch)
        if b.probe and key != last:  # its bucket was left (module doc): drop it
            b.probe.clear()
            b.probed = None
        if drain and (drain[0] <= 1 or drain[0] < self.warmup + 3 and self._last == PLAIN) and PLAIN in opts:
            return PLAIN  # a round yields no more, or a switch's first rounds (no tree yet) would not pay
        if b.probe:
            stand_in = b.choice if b.choice in opts else PLAIN if self.allow_plain else None
            return b.probe.popleft() if steady or stand_in is None else stand_in
        if b.hold and b.choice in opts:  # (a batch that shrank may not offer it)
            b.hold, b.steps_since_probe = b.hold - 1, b.steps_since_probe + 1
            return self._drained(b.choice, batch, b.costs, drain)
        b.hold = 0
        c, first = b.costs, first_option(batch, opts)
        if (plan := self._first_measurements(b, first, steady, opts)) is not None:
            return plan
        if c.halves_s is None and HALVES in opts and (half := self._buckets.get(self.key((batch + 1) // 2, context))):
            c.halves_est_s = halves_estimate(half.costs)  # unmeasured: H from half the batch's bucket
        rates = {p: r for p in opts if (r := predict(p, batch, c, self.k)) is not None}
        if not rates:
            return first
        ranked = sorted(rates, key=rates.get, reverse=True)
        best = ranked[0]
        if b.choice in rates and rates[b.choice] >= (1 - _MARGIN) * rates[best]:
            best = b.choice  # hold on to the choice unless another is clearly faster
        if b.probed is not None:  # a periodic probe has ended: it won, or the next one waits longer
            if self._extend_probe(b, batch, best, rates):
                return b.probe.popleft()
            b.backoff = 1 if best == b.probed else min(MAX_PROBE_BACKOFF, 2 * b.backoff)
            b.probed, b.stood = None, 0
        explore = unmeasured_alternative(batch, best, rates, opts, c, self.k)
        if explore is not None:
            return self._start_probe(b, explore)
        b.stood = b.stood + 1 if best == b.choice else 0
        self._set_choice(key, b, best, rates)
        b.steps_since_probe += 1
        wait = self.probe_every * b.backoff
        need = (DRAIN_PROBE_LEFT if batch > 1 else 1) * wait  # tokens left a draining batch's probe needs
        if len(ranked) > 1 and b.steps_since_probe >= wait and (drain is None or drain[0] >= need):
            b.steps_since_probe = 0
            if (plan := self._periodic_probe(b, batch, best, ranked, rates)) is not None:
                return plan
        b.hold = min(MAX_HOLD, RANK_EVERY << min(b.stood - RANK_EVERY, 8)) - 1 if b.stood >= RANK_EVERY else 0
        return self._drained(best, batch, c, drain)

    def _drained(self, choice: RoundPlan, batch: int, c: Costs, drain) -> RoundPlan:
        """The choice, or plain where the batch drains and the choice's spread makes it MARGIN slower (drain.py)."""
        plain = predict(PLAIN, batch, c, self.k) if drain and choice.speculate and PLAIN in self.options(batch) else 0
        rate = plain and drained_rate(predict(choice, batch, c, self.k), choice, batch, c, self.k, drain)
        return PLAIN if batch > 1 and rate and rate < (1 - _MARGIN) * plain else choice

    def _periodic_probe(self, b: _Bucket, batch: int, best: RoundPlan, ranked: list, rates: dict) -> RoundPlan | None:
        """A periodic probe's first step (the module doc says of which option), or None: a turn skipped."""
        c, others = b.costs, [p for p in ranked if p != best]
        hopeful = max(others, key=lambda p: model_rate(p, batch, c, self.k) or 0.0)
        if b.left in others:
            target, b.left = b.left, None
        elif (model_rate(hopeful, batch, c, self.k) or 0.0) > (1 + _MARGIN) * rates[best]:
            target = hopeful
        else:
            turn = (b.num_probes + 1) % 4 == 0 and len(others) > 1
            target = others[1 + ((b.num_probes + 1) // 4) % (len(others) - 1)] if turn else others[0]
            b.skipped = not b.skipped and rates[target] < (1 - CLOSE) * rates[best]
            if b.skipped:
                b.backoff = min(MAX_PROBE_BACKOFF, 2 * b.backoff)  # as after a probe that changed nothing
                return None
        b.num_probes += 1
        b.probed, b.extended = target, False
        return self._start_probe(b, target)

    def _first_measurements(self, b: _Bucket, first: RoundPlan, steady: bool, opts: list) -> RoundPlan | None:
        """What the bucket lacks (the largest tree, then c) is measured first, or None. A step of a filling batch
        measures nothing, and as a round would wait for the draft's prefill: plain. Until the batch size stood
        SETTLE_STEPS steps, the previous bucket's choice stands (not SSD). c may come from a floor (module doc)."""
        c, (n, ctx) = b.costs, self._visit[0]
        if c.chain_s is None and self.allow_sd:
            c.chain_s = max((o.costs.chain_s for (m, x), o in self._buckets.items() if m < n and x <= ctx
                             and o.costs.chain_window), default=None)
        unmeasured = first.kind == "ssd" and c.samples[("w", first.branches)] < max(self.warmup, _MIN_SAMPLES)
        no_chain = self.allow_sd and c.chain_s is None
        if not (unmeasured or no_chain):
            return None
        if not steady and self.allow_plain:
            return PLAIN
        *_, steps, came = self._visit
        came = SD if came == HALVES and HALVES not in opts else came
        if steps < SETTLE_STEPS and came is not None and not came.work_ahead and came in opts:
            return came
        return first if unmeasured else self._start_probe(b, SD)

    def _extend_probe(self, b: _Bucket, batch: int, best: RoundPlan, rates: dict) -> bool:
        """Whether the periodic probe just ended runs on once till its realized window is full: it lost by < CLOSE."""
        p = b.probed
        if b.extended or p == best or p not in rates or rates[p] < (1 - CLOSE) * rates[best]:
            return False
        missing = WINDOW - b.costs.realized_steps(p, batch)
        b.extended = missing > 0
        b.probe.extend([p] * missing)
        return b.extended

    def _start_probe(self, b: _Bucket, plan: RoundPlan) -> RoundPlan:
        b.costs.realized.pop(plan, None)  # the probe measures it afresh
        b.probe.extend([plan] * (self.probe_len + 2))  # the first three steps of a change realize nothing
        return b.probe.popleft()

    def _set_choice(self, key: tuple[int, int], b: _Bucket, plan: RoundPlan, rates: dict) -> None:
        if plan == b.choice:
            return
        self.num_switches += b.choice is not None
        b.backoff = 1  # the costs moved: probe at the full rate again
        b.left, b.choice = b.choice, plan
        others = ", ".join(f"{p.label()} {r:.0f}" for p, r in sorted(rates.items(), key=lambda x: -x[1]) if p != plan)
        logger.info("batch size ~%d, context up to %d tokens: %s (predicted %.0f tok/s; %s)", key[0], key[1],
                    plan.label(), rates[plan], others or "no other")

    # ---------------------------------------------------------------- measuring

    def record(self, batch: int, plan: RoundPlan, *, context: int = 0, wait_s: float, busy_s: float, num_specs: int = 0,
               num_hits: int = 0, num_drafted: int = 0, drafted_tokens: int = 0, draft_work_s: float = 0.0,
               steady: bool = True, stepped: int = 0, sent: RoundPlan | None = None, hit_ranks=None) -> None:
        """One step over `batch` sequences ran `plan`: waited wait_s for speculations (num_specs, num_hits from the
        tree cache, hit_ranks their ranks), spent busy_s on verify and host; num_drafted sequences yielded
        drafted_tokens; draft_work_s: the draft's work-ahead. Not steady (a sequence in its first rounds): measures
        nothing. stepped: the sequences run if fewer (halves); sent: its request's plan if not `plan` (ahead.py)."""
        key = self.key(batch, context)
        c = self._bucket(key).costs
        if logger.isEnabledFor(logging.DEBUG):  # the step record (scripts/replay_round_policy.py reads it)
            logger.debug("step batch %d context %d: %s%s%s%s, wait %.2f ms, busy %.2f ms, %d/%d hits, %d tokens "
                         "drafted by %d, work-ahead %.2f ms%s", batch, context, plan.label(),
                         f" ({stepped} run)" if stepped and stepped != batch else "",
                         f" (requests {sent.label()})" if sent and sent != plan else "",
                         "" if steady else " (first rounds)", 1e3 * wait_s, 1e3 * busy_s, num_hits, num_specs,
                         drafted_tokens, num_drafted, 1e3 * draft_work_s,
                         f", ranks {' '.join(map(str, sorted(hit_ranks)))}" if hit_ranks else "")
        (k3, p3), (k2, p2), (k1, p1) = self._history
        self._history.append((key, sent or plan))
        if not steady:
            return
        if num_drafted and not (p1 is not None and short_jit_len(p1.backup)):  # full-length speculations only
            c.add_tokens(drafted_tokens, num_drafted)
        if plan.kind == "halves":  # H and its realized rate only: a half's wait and verify are not S or c
            if num_specs and k3 == k2 == k1 == key and p3 == p2 == p1 == plan:
                share = batch / (stepped or batch)  # undrafted sequences yield a token each
                c.add_halves(seconds := share * (wait_s + busy_s))
                c.add_realized(plan, batch, share * (drafted_tokens - num_drafted) + batch, seconds)
            return
        if k1 != key or p1 is None:
            return
        if not plan.speculate:
            if not p1.speculate:
                c.add_plain(wait_s + busy_s)
                c.add_realized(plan, batch, batch, wait_s + busy_s)
            return
        if not num_specs:
            return
        if num_drafted:  # beside the work-ahead after the last request (no drafts: one token verified)
            c.add_verify(p1.work_ahead, busy_s)
        if k2 != key or p2 is None:
            return
        if p3 == p2 == p1 == plan and k3 == key:
            # Sequences without a draft (a miss with no backup) produce one token.
            c.add_realized(plan, batch, drafted_tokens + batch - num_drafted, wait_s + busy_s,
                           bool(num_hits < num_specs) if plan.work_ahead else None)
        if p2.kind == p1.kind == "sd":  # a chain drafted on request; the first after other steps also takes in
            c.add_chain(wait_s)  # their outcomes (on the target's GPU at once: 52.9 ms against about 8 on an H200)
        if p2.work_ahead and p2.branches == plan.branches and p1 == p2 and plan == p2:
            n = p2.branches
            if draft_work_s > 0:
                c.add_work(n, draft_work_s)
            c.add_hits(n, num_hits, num_specs, hit_ranks, self.shapes(batch))
            modelled = c.ssd_wait(batch, n, p2.backup, self.k)
            if modelled is not None:
                c.extra_s = _mean(c.extra_s, wait_s - modelled)

    def record_step(self, plan: RoundPlan, specs: dict, num_draft: list[int], num_accepted: list[int],
                    wait_s: float, busy_s: float, draft_work_s: float, steady: bool = True, context: int = 0,
                    batch: int = 0, sent: RoundPlan | None = None) -> None:
        """`record` from the worker's view of a step (DraftTokens that arrived; per sequence its drafts and accepted
        tokens); steady, sent as `record`'s; batch: the running sequences (a halves step)."""
        t0 = time.perf_counter()
        drafted = [j + 1 for j, m in zip(num_accepted, num_draft) if m]
        ranks = [s.hit_rank for s in specs.values() if s.cache_hit]
        self.record(batch or len(num_draft), plan, context=context, wait_s=wait_s, busy_s=busy_s, num_specs=len(specs),
                    num_hits=len(ranks), num_drafted=len(drafted), drafted_tokens=sum(drafted),
                    draft_work_s=draft_work_s, steady=steady, stepped=len(num_draft), sent=sent, hit_ranks=ranks)
        self.host_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- reading

    def engine_fields(self) -> dict:
        n = self.steps  # the policy's part of EngineStats
        return dict(num_plain_steps=n["plain"], num_ssd_rounds=n["ssd"], num_sd_rounds=n["sd"],
                    num_halves_steps=n["halves"], num_round_switches=self.num_switches,
                    round_choices=self.summary(), round_policy_s=self.host_s)

    def costs(self, batch: int, context: int = 0) -> Costs:
        return self._bucket(self.key(batch, context)).costs

    def _bucket(self, key: tuple[int, int], came_from: tuple[int, int] | None = None) -> _Bucket:
        if (b := self._buckets.get(key)) is None:  # no new _Bucket (and Costs) built per call for setdefault
            b = self._buckets[key] = _Bucket()
            src = self._buckets.get(came_from) if came_from else None  # (the same batch bucket)
            if src is not None and src.choice is not None and key[1] in (2 * came_from[1], came_from[1] // 2):
                # The batch's context crossed into the next bucket (module doc): start from its costs and choice.
                b.costs, b.choice, b.backoff = copy.deepcopy(src.costs), src.choice, src.backoff
                logger.info("batch size ~%d, context up to %d tokens: %s, from the costs up to %d tokens", key[0],
                            key[1], b.choice.label(), came_from[1])
        return b

    def summary(self) -> dict[int, str]:
        """The choice per batch-size bucket (at the context of its last step), for stats and logs."""
        buckets = ((batch_key, self._buckets.get(key)) for batch_key, key in sorted(self._current.items()))
        return {batch_key: b.choice.label() for batch_key, b in buckets if b is not None and b.choice is not None}
