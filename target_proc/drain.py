"""What a speculating step costs a batch that drains: the spread it adds between its sequences.

A plain step advances every sequence of a batch by one token; a speculating one advances each
by its accepted tokens + 1, which scatter (1 to K + 1). While requests wait, a finished sequence's
place is taken at once. When none waits, the batch runs on at a smaller size from its first
sequence's end until its last one's: a batch whose sequences each need at most `left` more tokens
takes as long as its slowest. After R rounds of a plan whose tokens per sequence have mean a and
variance v, the sequences' positions scatter with variance v R on top of the spread s they have
already (the standard deviation of their remaining tokens), and the last of B sequences ends about
z(B) (sqrt(s^2 + v R) - s) tokens after the mean, z(B) the expected largest of B standard normal
samples. Those tokens run at most one per step of a smaller batch, each costing at most a plain
step P. Over the tokens still to decode, a plan of rate r (tokens/s over the batch) so takes

    left B / r + z(B) (sqrt(s^2 + v left / a) - s) P

and `drained_rate` is its rate over that time. Plain steps add no spread. The per-token
acceptance x behind a (a = 1 + x + ... + x^K) gives v; a miss without a backup yields 1 token,
one with a short jit backup an N-token chain's.

Pure arithmetic, no torch."""

from __future__ import annotations

import functools
import math
from statistics import NormalDist


def short_jit_len(backup: str) -> int:
    """N of a short jit backup `jit:N`, 0 for any other backup."""
    return int(backup[4:]) if backup.startswith("jit:") else 0


def _powers_sum(x: float, n: int) -> float:
    """x + x^2 + ... + x^n for 0 <= x <= 1."""
    return float(n) if x >= 1.0 else x * (1.0 - x ** n) / (1.0 - x)


@functools.lru_cache(maxsize=256)
def acceptance(tokens: float, k: int) -> float:
    """The per-token acceptance x with x + ... + x^k = tokens - 1 (tokens: accepted + 1 per round)."""
    target = min(max(tokens - 1.0, 0.0), float(k))
    lo, hi = 0.0, 1.0
    for _ in range(40):
        x = (lo + hi) / 2
        if _powers_sum(x, k) < target:
            lo = x
        else:
            hi = x
    return lo


@functools.lru_cache(maxsize=256)
def chain_tokens(tokens: float, k: int, n: int) -> float:
    """Tokens per round (accepted + 1) of an n-token chain, given `tokens` for k tokens: the
    acceptance x at k, summed to n. Cached: the policy asks it for every short-jit option of
    every step, with one `tokens` per step."""
    return 1.0 + _powers_sum(acceptance(tokens, k), n)


def chain_moments(x: float, n: int) -> tuple[float, float]:
    """E[J] and E[J^2] of the tokens J accepted from an n-token chain at per-token acceptance x:
    P(J >= j) = x^j, so E[J] = sum x^j and E[J^2] = sum (2j - 1) x^j over j = 1..n."""
    mean = square = 0.0
    p = 1.0
    for j in range(1, n + 1):
        p *= x
        mean += p
        square += (2 * j - 1) * p
    return mean, square


def round_moments(kind: str, backup: str, tokens: float, hit: float | None, k: int) -> tuple[float, float]:
    """Mean and variance of one round's tokens per sequence (accepted + 1) for a plan of `kind`
    with `backup`, from a (`tokens`, at speculation length k) and the tree's hit rate: SD, halves
    and the jit backup verify a full chain; a miss yields 1 token without a backup, an N-token
    chain's with `jit:N`. An unmeasured hit rate counts as a full chain."""
    x = acceptance(tokens, k)
    mean, square = chain_moments(x, k)
    n = short_jit_len(backup)
    if kind == "ssd" and hit is not None and (backup == "none" or n):
        miss_mean, miss_square = chain_moments(x, n) if n else (0.0, 0.0)
        mean, square = hit * mean + (1.0 - hit) * miss_mean, hit * square + (1.0 - hit) * miss_square
    return 1.0 + mean, max(0.0, square - mean * mean)


@functools.lru_cache(maxsize=128)
def spread_z(batch: int) -> float:
    """The expected largest of `batch` standard normal samples: the integral of x B pdf(x) cdf(x)^(B-1)
    over x, by the midpoint rule on [-8, 8] (0 for one sample)."""
    if batch < 2:
        return 0.0
    normal, n = NormalDist(), 1600
    xs = [-8.0 + 16.0 * (i + 0.5) / n for i in range(n)]
    return sum(x * normal.pdf(x) * normal.cdf(x) ** (batch - 1) for x in xs) * batch * 16.0 / n


def drained_rate(rate: float | None, plan, batch: int, c, k: int, drain: tuple[int, float] | None) -> float | None:
    """`rate` of `plan` at `batch` sequences over the time the batch's drain adds to it (module doc),
    drain = (left, spread) of the batch's remaining tokens, c its bucket's Costs; `rate` where drain is
    None (a request waits), for plain steps, at batch 1 and while a or P is unmeasured."""
    p = c.plain_s if c.plain_s is not None else c.verify(False)
    if rate is None or rate <= 0 or drain is None or plan.kind == "plain" or batch < 2 or not k or not p \
            or c.tokens is None:
        return rate
    left, spread = drain
    a, v = round_moments(plan.kind, plan.backup, c.tokens, c.long_hit_rate(plan.branches), k)
    extra = spread_z(batch) * (math.sqrt(spread * spread + v * left / a) - spread)
    return left * batch / (left * batch / rate + extra * p)


def batch_drain(remaining: list[int], waiting: int) -> tuple[int, float] | None:
    """(the most tokens any sequence may still decode, the standard deviation of those counts),
    or None while a request waits to take a finished sequence's place."""
    if waiting or not remaining:
        return None
    n = len(remaining)
    mean = sum(remaining) / n
    return max(remaining), math.sqrt(max(0.0, sum(r * r for r in remaining) / n - mean * mean))
