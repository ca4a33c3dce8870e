"""The round policy's plans and cost model: what one step may run (RoundPlan), what is
measured per bucket (Costs), and the predicted tokens/s of each plan (model_rate). The
options are in target_proc/round_policy.py's module doc.

What it measures (per bucket, from the worker's step timings and the draft's answers;
S, P, H and W[n] the median of their last 8 samples, steps that take about the same
time each, so that one stall does not move them (the least of one or two samples: a
halves probe yields one sample of H); h and e running means):
  S      the step's verify and host work, with and without a work-ahead beside it;
  P      a plain step;
  H      a halves step, scaled to the whole batch;
  c      the wait for a chain drafted on request (SD rounds: the draft's chain step,
         transfer included), the least of its last 8; till then any floor known (round_policy.py);
  W[n]   the draft's work-ahead at shape n (glue + K tree steps), as it reports it;
  h[n]   the share of look-ups that hit a tree of shape n (smaller n also in larger trees);
         a plan's expected tokens take it over the last 64 rounds (Costs.long_hit_rate);
  a      tokens per sequence per round with a full speculation (accepted + 1), the
         mean over the last 32 rounds;
  e      what SSD rounds wait beyond the model below (transfer, answer time).
The prediction for B sequences:
  plain          B / min(P, S) (a plain step verifies 1 token per sequence, S K + 1)
  SD             B a / (S + c)
  halves         B a / H, H a halves step's time as its share of the whole batch's
                 (2x for an even split); until measured, B a / max(S, c, 0.85 x 2 max(S', c'))
                 with S' and c' those of the bucket of half the batch, where measured
                 (halves_estimate)
  SSD n, jit     B a / (S + max(0, W[n] - S) + (1 - h[n]^B) c + e)
  SSD n, jit:N   B (h a + (1 - h) a_N) / (S + max(0, W[n] - S) + (1 - h[n]^B) c (N+1)/(K+1) + e)
  SSD n, none    B (h a + 1 - h) / (S + max(0, W[n] - S) + e)
where a_N is a for an N-token chain (the per-token acceptance that gives a at K, summed
over N tokens). The work-ahead runs while the target verifies, so only its overrun
costs; one miss in the batch makes the whole answer wait for the jit chain, which is why
a short chain, or `none` (a missed sequence verifies only its own token), can win at
large batch. Halves pay where the verify grows with the batch (long contexts, large
batch): two half-batch verifies then cost little more than one whole, and each hides the
other half's chain.

The model ranks options nobody has run yet. Once an option has run, its realized rate
stands in for the prediction: the expected tokens of its last 8 steps (B a for SD and for
SSD with jit, B for plain steps, the model's mix of hits and misses for the other
backups) over those steps' wait and busy time (a halves step's as in H), stalled steps
left out (Costs.realized_rate; SSD steps with and without a miss weighed by the long-run hit
rate, where the window holds both). Only steps of about the current batch size
count (within an eighth of it): a bucket spans batch sizes up to twice apart, and steps
run while a batch filled up would rate an option at the full batch far too low. Below the
batch size of its last steps (sequences finished since), the model is scaled by what the
option realized against it there (predict). What differs between options is
their time; one step's tokens scatter too widely at small batch.

Pure bookkeeping, no torch."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from target_proc.drain import chain_tokens, short_jit_len  # noqa: F401 - re-exported

DECAY = 0.8  # weight of a running mean's past
OUTLIER = 4.0  # a running mean takes a sample at most this factor off it
MIN_SAMPLES = 2  # measurements of W[n] and h[n] before a tree shape is predicted
WINDOW = 8  # steps of each option's realized rate kept
REALIZED_MIN = 3  # steps before a realized rate counts
STALL = 3.0  # an SSD step this many times the window's median is a stall, left out of a realized rate
STEADY_STALL = 1.5  # the same for the other plans, whose steps take about the same time each
TOKENS_WINDOW = 32  # steps behind the mean tokens per sequence per round
HITS_WINDOW = 64  # look-up rounds behind a tree shape's long-run hit rate (realized_rate's weights)
MARGIN = 0.03  # the round policy's choice changes only for a prediction this much faster
PLAIN_PRIOR_SLACK = 1.5  # plain decoding is measured once its floor estimate comes this close to the best
HALVES_SLACK = 0.85  # an unmeasured halves step is estimated at this share of two half-batch steps
NONE_FIRST_FROM = 4  # batch sizes from which the largest tree is first measured with backup none


class RoundPlan(NamedTuple):
    """One step's choice. kind: "ssd", "sd", "halves" (an SD round over one of two halves
    of the batch, in turn: the draft chains one half while the target verifies the other)
    or "plain". branches: SSD branches per sequence (0: the draft's own). backup: what
    answers the next round's misses ("": the configured backup). A tuple: the policy keys
    its windows and rates by plan at every step, and a tuple hashes in C."""

    kind: str
    branches: int = 0
    backup: str = ""

    @property
    def speculate(self) -> bool:
        return self.kind != "plain"

    @property
    def work_ahead(self) -> bool:
        return self.kind == "ssd"

    def label(self) -> str:
        if self.kind != "ssd":
            return self.kind
        shape = f"{self.branches} branches" if self.branches else "configured tree"
        return f"ssd {shape}, backup {self.backup or 'configured'}"


SD = RoundPlan("sd")
HALVES = RoundPlan("halves")
# A plain step asks the draft only to take in the outcomes (no work-ahead, backup none): it
# drafts nothing that nobody waits for, so it neither slows a verify on a shared GPU nor
# falls behind. A speculating step right after one gets answers without drafts.
PLAIN = RoundPlan("plain", backup="none")


def running_mean(old: float | None, x: float) -> float:
    """The mean after x; a sample is first clamped to [old / OUTLIER, old * OUTLIER], so
    one stall (a kernel built on first use) does not skew the mean for many steps."""
    if old is None:
        return x
    if old > 0:
        x = min(max(x, old / OUTLIER), old * OUTLIER)
    return DECAY * old + (1 - DECAY) * x


@dataclass
class Costs:
    """The measurements of one batch-size bucket (see the module doc)."""

    verify_s: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    plain_s: float | None = None
    halves_s: float | None = None  # a halves step, as its share of the whole batch's time
    halves_est_s: float | None = None  # H estimated from half the batch's bucket until measured (halves_estimate)
    chain_s: float | None = None
    chain_window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    work_s: dict[int, float] = field(default_factory=dict)
    hit_rate: dict[int, float] = field(default_factory=dict)
    hit_window: dict = field(default_factory=dict)  # branches -> deque of (hits, looked up) of its last rounds
    hit_sums: dict = field(default_factory=dict)  # branches -> (hits, looked up) summed over hit_window
    tokens: float | None = None
    tokens_window: deque = field(default_factory=lambda: deque(maxlen=TOKENS_WINDOW))
    extra_s: float = 0.0
    samples: Counter = field(default_factory=Counter)
    realized: dict = field(default_factory=dict)  # RoundPlan -> deque of (sequences, tokens, seconds, missed)
    steady: dict = field(default_factory=dict)  # S, P, H and W[n]: the last WINDOW samples of each (_steady)

    def _steady(self, key, seconds: float) -> float:
        """The median of the last WINDOW samples of `key`, `seconds` the newest. S, P, H and
        W[n] are times of steps that take about the same each: one stall (the first plain
        step at a new batch size took 0.76 s on an H100 host) would hold a running mean up
        for many steps, and each is measured again only while its plan runs."""
        window = self.steady.get(key)
        if window is None:
            window = self.steady[key] = deque(maxlen=WINDOW)
        window.append(seconds)
        # Below three samples a median cannot tell a stall from the step's time; a stall
        # only adds time, so the least stands until a third sample comes.
        return _median(window) if len(window) >= 3 else min(window)

    def add_plain(self, seconds: float) -> None:
        """One plain step (P)."""
        self.plain_s = self._steady("P", seconds)

    def add_verify(self, work_ahead: bool, seconds: float) -> None:
        """One speculating step's verify and host work (S), beside a work-ahead or not."""
        self.verify_s[work_ahead] = self._steady(("S", work_ahead), seconds)

    def add_halves(self, seconds: float) -> None:
        """One halves step, as its share of the whole batch's time (H)."""
        self.halves_s = self._steady("H", seconds)

    def add_work(self, branches: int, seconds: float) -> None:
        """One work-ahead at tree shape `branches`, as the draft reported it (W[n])."""
        self.work_s[branches] = self._steady(("W", branches), seconds)
        self.samples[("w", branches)] += 1

    def add_hits(self, branches: int, hits: int, looked_up: int, ranks=None, shapes=()) -> None:
        """One SSD round's look-ups in a tree of `branches` (h[branches]); where each hit's rank
        came (DraftTokens.hit_rank), also h of the smaller `shapes`: a tree of n holds ranks < n.
        Each shape's last HITS_WINDOW rounds of look-ups are kept too, with their sums."""
        ranked = ranks is not None and min(ranks, default=0) >= 0
        for n, n_hits in [(branches, hits)] + [(n, sum(r < n for r in ranks)) for n in shapes
                                               if ranked and 0 < n < branches]:
            self.hit_rate[n] = running_mean(self.hit_rate.get(n), n_hits / looked_up)
            window = self.hit_window.setdefault(n, deque(maxlen=HITS_WINDOW))
            old = window[0] if len(window) == HITS_WINDOW else (0, 0)
            window.append((n_hits, looked_up))
            h, m = self.hit_sums.get(n, (0, 0))
            self.hit_sums[n] = (h + n_hits - old[0], m + looked_up - old[1])

    def long_hit_rate(self, branches: int) -> float | None:
        """h[branches] over its last HITS_WINDOW rounds (the running mean below WINDOW of them): what a plan's
        tokens are expected from, where h's running mean follows the last few rounds' luck."""
        window, (h, n) = self.hit_window.get(branches, ()), self.hit_sums.get(branches, (0, 0))
        return h / n if len(window) >= WINDOW and n else self.hit_rate.get(branches)

    def add_chain(self, wait_s: float) -> None:
        """One wait for a chain drafted on request. c is the least of the last WINDOW: a
        chain's cost is what it takes undisturbed, and a stall (a kernel built on first
        use, a work-ahead still finishing) only adds to it."""
        self.chain_window.append(wait_s)
        self.chain_s = min(self.chain_window)

    def add_tokens(self, tokens: int, sequences: int) -> None:
        """One round's full-length speculations: `tokens` (accepted + 1, summed) over
        `sequences`. a is the mean over the last TOKENS_WINDOW rounds: a round's tokens
        scatter widely (1 to K + 1 per sequence at batch 1)."""
        self.tokens_window.append((tokens, sequences))
        self.tokens = sum(t for t, _ in self.tokens_window) / sum(n for _, n in self.tokens_window)

    def tokens_per_sequence(self, plan: "RoundPlan", k: int = 0) -> float | None:
        """Expected tokens per sequence of one step of `plan`: 1 for a plain step, a for SD and SSD with the jit backup
        (each sequence verifies a full speculation), the model's mix of hits and misses (long_hit_rate) for `none`
        and `jit:N`; None for the configured backup (the step's own tokens count) or while a or h is unmeasured."""
        if plan.kind == "plain" or self.tokens is None:
            return 1.0 if plan.kind == "plain" else None
        if plan.kind in ("sd", "halves") or plan.backup == "jit":
            return self.tokens
        h, n = self.long_hit_rate(plan.branches), short_jit_len(plan.backup)
        if h is None or not (plan.backup == "none" or (n and k)):
            return None
        missed = 1.0 if plan.backup == "none" else chain_tokens(self.tokens, k, n)
        return h * self.tokens + (1.0 - h) * missed

    def realized_rate(self, plan: "RoundPlan", k: int = 0, batch: int | None = None) -> float | None:
        """Tokens/s of `plan` over its last steps, None below REALIZED_MIN of them: the
        expected tokens of its steps (tokens_per_sequence, else their own) over the
        steps' time. A stall (a kernel built on first use, an admission, a host hiccup
        that holds up a few steps in a row) is left out: an SSD step over STALL times the
        window's median, as SSD steps wait for the jit chain whenever a sequence misses;
        a step of another plan, whose steps each take about the same time, over
        STEADY_STALL times. Time, not each step's tokens/s, is what a plan's steps realize: at batch 1 a step's
        tokens range from 1 to K + 1, and a window of such ratios would rank options by luck.

        batch: count only steps of about this many sequences (within an eighth). A bucket holds batch sizes up to
        twice apart, and a rate realized while a batch was filling (9 sequences) says little about the full one
        (16): the step's fixed costs are spread over fewer tokens.

        An SSD step with a miss waits for the jit chain: 8 steps at a hit rate of 0.84 hold 1.3 misses, give or
        take 1 (7% of their time at batch 1). Where the window holds steps with and without one at one batch size
        B, and the shape HITS_WINDOW rounds of look-ups, the step time is the two kinds' means weighed by h^B (no
        sequence misses), h over those."""
        window = self.realized.get(plan)
        if window and batch is not None:
            window = [e for e in window if abs(e[0] - batch) <= batch // 8]
        if not window or len(window) < REALIZED_MIN:
            return None
        cap = (STALL if plan.work_ahead else STEADY_STALL) * _median([e[2] for e in window])
        kept = [e for e in window if e[2] <= cap]
        sequences, tokens, seconds = (sum(e[i] for e in kept) for i in range(3))
        per_seq = self.tokens_per_sequence(plan, k)
        tokens = tokens if per_seq is None else per_seq * sequences
        hits = self.hit_window.get(plan.branches, ()) if plan.work_ahead and per_seq is not None else ()
        split = [[e[2] for e in kept if e[3] is m] for m in (False, True)] if len(hits) == HITS_WINDOW else ()
        if split and all(split) and len({e[0] for e in kept}) == 1:
            q = self.long_hit_rate(plan.branches) ** kept[0][0]
            hit_s, miss_s = (sum(x) / len(x) for x in split)
            return tokens / len(kept) / (q * hit_s + (1 - q) * miss_s)
        return tokens / seconds

    def realized_steps(self, plan: "RoundPlan", batch: int) -> int:
        """How many of `plan`'s realized steps ran about `batch` sequences (as realized_rate counts them)."""
        return sum(1 for e in self.realized.get(plan, ()) if abs(e[0] - batch) <= batch // 8)

    def add_realized(self, plan: "RoundPlan", sequences: int, tokens: float, seconds: float,
                     missed: bool | None = None) -> None:
        """One step of `plan`; missed: an SSD step where a sequence missed the tree (None: not one)."""
        if seconds > 0:
            self.realized.setdefault(plan, deque(maxlen=WINDOW)).append((sequences, tokens, seconds, missed))

    def verify(self, work_ahead: bool) -> float | None:
        v = self.verify_s[work_ahead]
        return v if v is not None else self.verify_s[not work_ahead]

    def ssd_wait(self, batch: int, branches: int, backup: str, k: int = 0) -> float | None:
        """The modelled wait of an SSD round, e left out; None until W and h are measured.
        k: the full speculation length (scales the chain for a short jit, `jit:N`)."""
        s, w, h = self.verify(True), self.work_s.get(branches), self.hit_rate.get(branches)
        if s is None or w is None or h is None or self.samples[("w", branches)] < MIN_SAMPLES:
            return None
        n = short_jit_len(backup)
        chain = (self.chain_s or 0.0) * ((n + 1) / (k + 1) if n and k else 1.0)
        miss = 0.0 if backup == "none" else (1.0 - h ** batch) * chain
        return max(0.0, w - s) + miss


def _median(xs: Iterable[float]) -> float:
    """statistics.median, without its checks of the values' types (the policy's every step)."""
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def predict(plan: RoundPlan, batch: int, c: Costs, k: int = 0) -> float | None:
    """Tokens/s of `plan` for `batch` sequences: as realized where it has run at about this
    batch size; else as the model predicts. Where the plan's last steps ran a larger batch
    (sequences have finished since), the model is scaled by what the plan realized against
    it there: the model takes c as the least of its waits and leaves out what a switch
    costs, and the full batch measured what that comes to. Not from a smaller batch: steps
    while a batch fills up run beside admissions. None while an input is unmeasured. k: the
    full speculation length."""
    realized = c.realized_rate(plan, k, batch)
    if realized is not None:
        return realized
    model = model_rate(plan, batch, c, k)
    window = c.realized.get(plan)
    if model is None or not window or window[-1][0] < batch:
        return model
    there = window[-1][0]
    realized, modelled = c.realized_rate(plan, k, there), model_rate(plan, there, c, k)
    return model * realized / modelled if realized and modelled else model


def model_rate(plan: RoundPlan, batch: int, c: Costs, k: int = 0) -> float | None:
    """The module doc's prediction of `plan`'s tokens/s, or None while an input is unmeasured."""
    if plan.kind == "plain":
        # P at most S: a plain step verifies one token per sequence, a speculating one K + 1. Unmeasured, or from
        # a first step slowed beside the draft's prefill (on its GPU), S stands in: a floor on the rate.
        s = c.verify(False)
        p = s if c.plain_s is None else c.plain_s if s is None else min(c.plain_s, s)
        return batch / p if p else None
    if c.tokens is None:
        return None
    if plan.kind == "halves" and c.halves_s is not None:
        return batch * c.tokens / c.halves_s
    if plan.kind in ("sd", "halves"):
        s = c.verify(False)
        if s is None or c.chain_s is None:
            return None
        # Halves, unmeasured: each half's verify and chain take at least half of the whole
        # batch's (S/2, c/2), a half's chain overlaps the other half's verify; and where the
        # bucket of half the batch is measured, about two of its verifies or chains.
        halves = max(s, c.chain_s, c.halves_est_s or 0.0)
        return batch * c.tokens / (halves if plan.kind == "halves" else s + c.chain_s)
    wait = c.ssd_wait(batch, plan.branches, plan.backup, k)
    if wait is None:
        return None
    per_seq = c.tokens_per_sequence(plan, k)
    tokens = batch * (c.tokens if per_seq is None else per_seq)  # the configured backup: as jit
    return tokens / (c.verify(True) + max(0.0, wait + c.extra_s))


def halves_estimate(half: Costs | None) -> float | None:
    """H, unmeasured, from the bucket of half the batch (None: its S or c unmeasured): a halves
    step verifies one half while the draft chains the other, two step the whole batch. H was 0.87x
    or more of 2 max(S, c) in docs/benchmarks.md's runs: HALVES_SLACK of it, on the fast side."""
    if half is None or half.chain_s is None or (s := half.verify(False)) is None:
        return None
    return HALVES_SLACK * 2.0 * max(s, half.chain_s)


def first_option(batch: int, opts: list[RoundPlan]) -> RoundPlan:
    """The option a bucket measures first: opts[0] (the largest tree, jit), or from batch
    NONE_FIRST_FROM the largest tree with backup none. W[n] and h[n] measure the same under
    either backup, and at a hit rate near 0.8 most rounds of four sequences or more have a
    miss, each of which makes the whole batch wait for a jit chain: SSD measured so looks
    no better than SD, and a cold policy spends its first steps on SD rounds and halves."""
    if batch >= NONE_FIRST_FROM:
        for p in opts:
            if p.kind == "ssd" and p.backup == "none" and p.branches == opts[0].branches:
                return p
    return opts[0]


def smaller_work(work_s: float, branches: int, smaller: int, chain_s: float | None) -> float:
    """A lower estimate of the work-ahead of a tree of `smaller` branches per sequence, from
    one of `branches` that took work_s: along the line from a chain's wait (one branch: the
    same forwards at one row per sequence, without the tree's host work) to work_s. A tree's
    work grows less than in proportion to its branches (its forwards read the weights
    whatever their rows), so the line stays at or below it; 0 while c is unmeasured."""
    if chain_s is None or branches <= 1:
        return 0.0
    base = min(chain_s, work_s)
    return base + (work_s - base) * (max(smaller, 1) - 1) / (branches - 1)


def unmeasured_alternative(batch: int, best: RoundPlan, rates: dict, opts: list[RoundPlan], c: Costs,
                           k: int) -> RoundPlan | None:
    """An option worth measuring before `best` runs: plain decoding while P was never
    measured and its floor estimate (P taken as S) is within PLAIN_PRIOR_SLACK of
    `best`; the next smaller tree below one that overruns the verify, when it would
    beat `best` at its hit rate (Costs.add_hits; else the larger one's, at most that)
    and with the work smaller_work estimates for it."""
    if c.plain_s is None and PLAIN in rates and PLAIN_PRIOR_SLACK * rates[PLAIN] >= rates[best]:
        return PLAIN
    s = c.verify(True)
    if s is None or c.tokens is None:
        return None
    for backup in dict.fromkeys(p.backup for p in opts if p.kind == "ssd" and p.branches):
        shapes = [p for p in opts if p.kind == "ssd" and p.branches and p.backup == backup]
        for larger, smaller in zip(shapes, shapes[1:]):
            measured = c.samples[("w", smaller.branches)] >= MIN_SAMPLES
            if measured or c.samples[("w", larger.branches)] < MIN_SAMPLES or larger.branches not in c.hit_rate:
                continue
            if c.work_s[larger.branches] <= s:
                break  # the larger tree fits: a smaller one cannot be faster
            # The smaller tree's rate at its hit rate and at least its work (smaller_work).
            w = smaller_work(c.work_s[larger.branches], larger.branches, smaller.branches, c.chain_s)
            fit = Costs(verify_s=c.verify_s, chain_s=c.chain_s, work_s={0: w}, tokens=c.tokens, extra_s=c.extra_s,
                        hit_rate={0: c.hit_rate.get(smaller.branches, c.hit_rate[larger.branches])},
                        samples=Counter({("w", 0): MIN_SAMPLES}))
            if model_rate(RoundPlan("ssd", 0, backup), batch, fit, k) > (1 + MARGIN) * rates[best]:
                return smaller
            break
    return None

