"""Synthetic acceptance oracle: benchmark-only replacement of the two LM heads' outputs.

Random-weight models agree on nothing, so GPU benchmarks of real-size random models
replace the numbers that come out of each LM head, after its real forward, so that
acceptance follows configured rates through the real machinery:

  o_t        the oracle token at position t: hash(request seed, t) mod vocab. It depends
             on (seed, t) only, never on the tokens before t.
  target     its logits at t become a distribution peaked on o_t: logit 0 on o_t and
             -1e4 elsewhere (one-hot at every temperature, so the target's text is the
             oracle stream), or, with peak_mass < 1, mass peak_mass on o_t at temperature
             1 and the rest spread evenly.
  draft      its logits at t put o_t at rank 1 with probability alpha; otherwise (with
             probability 1 - alpha) at rank r = 2, 3, ... with conditional probability
             ranks[r - 2], and outside its top slots with what is left. So alpha 0.8
             with ranks 0.5,0.2,0.1 puts o_t at rank 2 with probability 0.1. The
             top slots have logits top_logit, top_logit - gap, ... (a clear top-1, so a
             greedy draft takes rank 1); every other token gets -1e4. The tokens in the
             slots o_t does not take are pseudo-random: consecutive ids (mod vocab) after
             a hashed offset, all distinct from o_t and from each other.

Performance: the oracle is not part of what a benchmark measures, so it keeps off the
critical paths as far as it can. The target's hashing runs on the host in NumPy over a few
tiny arrays (about a third of the time of the same ops in torch on the CPU; in torch ops on
the GPU it would be ~75 kernel launches a call), then one copy and one scatter touch the
device. The draft's, which sits on the draft's critical path, is one kernel on a GPU
(oracle_device.py) with the same hash bits, so a transform costs the host a launch; off a
GPU it hashes in NumPy as the target does.

Every choice is a pure function of (request seed, t), through the counter-based hash of
`spec_runtime.sampling` on streams of its own, so every SSD branch that shares the true
prefix sees the same draft prediction at t. t is the position of the token the logits
predict (the same convention as sampling). The input logits only supply shape, dtype
and device: their values are discarded. Never on by default.

Wiring: `--synthetic-acceptance ALPHA[,R2,R3,...]` (SpeculativeConfig.synthetic_acceptance)
makes each process build its half here (`target_oracle`, `draft_oracle`) and hand it to
the one hook it has, `logits_transform(logits [N, V], seqs, positions [N]) -> logits`:
row i predicts position positions[i] of seqs[i].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from spec_runtime.engine.forward_batch import upload_int64
from spec_runtime.sampling import hash32, hash_to_unit, to_device

STREAM_ORACLE_TOKEN = 101
STREAM_ORACLE_RANK = 102
STREAM_ORACLE_FILL = 103
# Far below any top slot, and representable in float16/bfloat16.
MASKED_LOGIT = -1e4
# The draft always shows at least this many top slots, so forks have candidates.
MIN_DRAFT_SLOTS = 4
TOP_LOGIT, GAP = 10.0, 1.0  # the draft's top slot logit, and the step down to each next slot


_INDEX0 = np.zeros(1, dtype=np.int64)


def _host(x) -> np.ndarray:
    """int64 NumPy values of a tensor or array (seeds and positions: host values)."""
    return (x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).astype(np.int64, copy=False)


def _token(seeds: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    return hash32(seeds, positions, STREAM_ORACLE_TOKEN, _INDEX0)[..., 0] % vocab  # [*N]


def oracle_token(seeds, positions, vocab: int) -> torch.Tensor:
    """o_t: [*N] seeds, [*N] positions -> [*N] int64 in [0, vocab) (a CPU tensor)."""
    return torch.from_numpy(_token(_host(seeds), _host(positions), vocab))


def target_oracle_logits(logits: torch.Tensor, seeds, positions, peak_mass: float = 1.0) -> torch.Tensor:
    """Target logits [*N, V] -> logits of the same shape and dtype peaked on o_t.

    peak_mass 1.0 (default): 0 on o_t, -1e4 elsewhere, one-hot after any temperature;
    peak_mass < 1: p(o_t) = peak_mass at temperature 1, the rest uniform. Greedy
    rows take o_t either way.
    """
    if not 0.0 < peak_mass <= 1.0:
        raise ValueError(f"peak_mass must be in (0, 1], got {peak_mass}")
    vocab = logits.shape[-1]
    o = to_device(oracle_token(seeds, positions, vocab), logits.device)  # [*N]
    if peak_mass >= 1.0 or vocab == 1:
        rest = MASKED_LOGIT
    else:
        # 1 / (1 + (V-1) e^rest) = peak_mass
        rest = max(math.log((1.0 - peak_mass) / (peak_mass * (vocab - 1))), MASKED_LOGIT)
    out = torch.full_like(logits, rest)
    return out.scatter_(-1, o.unsqueeze(-1), 0.0)


def _rank(seeds: np.ndarray, positions: np.ndarray, alpha: float, ranks: tuple[float, ...]) -> np.ndarray:
    if not 0.0 <= alpha <= 1.0 or any(r < 0 for r in ranks) or sum(ranks) > 1.0 + 1e-9:
        raise ValueError(f"need alpha in [0, 1], ranks >= 0, sum(ranks) <= 1; got {alpha}, {ranks}")
    u = hash_to_unit(hash32(seeds, positions, STREAM_ORACLE_RANK, _INDEX0))  # [*N, 1]: uniform()'s bits
    return (u >= cumulative_bounds(alpha, ranks)).sum(-1)  # [*N]


def cumulative_bounds(alpha: float, ranks: tuple[float, ...]) -> np.ndarray:
    """The rank of o_t is how many of these u reaches: alpha, then alpha + (1 - alpha) * P2, ..."""
    return np.array([alpha + (1.0 - alpha) * sum(ranks[:i]) for i in range(len(ranks) + 1)], dtype=np.float64)


def draft_oracle_rank(seeds, positions, alpha: float, ranks: tuple[float, ...]) -> torch.Tensor:
    """0-based rank of o_t in the draft at (seed, t): [*N] -> [*N] int64 (a CPU tensor).

    0 with probability alpha, r - 1 with probability (1 - alpha) * ranks[r - 2], and
    1 + len(ranks) ("absent") with the remaining probability.
    """
    return torch.from_numpy(_rank(_host(seeds), _host(positions), alpha, ranks))


def _num_slots(vocab: int, ranks: tuple[float, ...]) -> int:
    num_slots = min(max(MIN_DRAFT_SLOTS, len(ranks) + 2), vocab - 1)
    if num_slots < len(ranks) + 1:
        raise ValueError(f"vocab {vocab} too small for {len(ranks) + 1} ranks")
    return num_slots


def _slots(seeds: np.ndarray, positions: np.ndarray, vocab: int, alpha: float, ranks: tuple[float, ...],
           top_logit: float, gap: float) -> tuple[np.ndarray, np.ndarray]:
    num_slots = _num_slots(vocab, ranks)
    if not gap > 0.0:
        raise ValueError(f"gap must be > 0, got {gap}")
    o = _token(seeds, positions, vocab)[..., None]  # [*N, 1]
    r0 = _rank(seeds, positions, alpha, ranks)[..., None]  # [*N, 1]
    r0 = np.where(r0 > len(ranks), num_slots, r0)  # absent: past every slot
    slot = np.arange(num_slots)  # [S]
    # Fillers: vocab - 1 ids other than o_t, walked from a hashed offset, so the first
    # num_slots of them are distinct.
    offset = hash32(seeds, positions, STREAM_ORACLE_FILL, _INDEX0) % (vocab - 1)  # [*N, 1]
    fill_idx = np.maximum(np.where(slot < r0, slot, slot - 1), 0)  # [*N, S]
    fillers = (o + 1 + (offset + fill_idx) % (vocab - 1)) % vocab  # [*N, S]
    slot_tokens = np.where(slot == r0, o, fillers)  # [*N, S]
    return slot_tokens, top_logit - gap * np.arange(num_slots, dtype=np.float32)  # [S]


def draft_oracle_slots(seeds, positions, vocab: int, alpha: float, ranks: tuple[float, ...] = (),
                       top_logit: float = TOP_LOGIT, gap: float = GAP) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft oracle's top slots at (seed, t): token ids [*N, S] int64 and their logits
    [S] float32, CPU tensors (module docstring). Everything else gets MASKED_LOGIT."""
    tokens, logits = _slots(_host(seeds), _host(positions), vocab, alpha, ranks, top_logit, gap)
    return torch.from_numpy(tokens), torch.from_numpy(logits)


def scatter_slots(logits: torch.Tensor, slot_tokens: torch.Tensor, slot_logits: torch.Tensor) -> torch.Tensor:
    """Logits of logits' shape: MASKED_LOGIT except slot_logits [S] at slot_tokens [*N, S]
    (both already on logits' device)."""
    out = torch.full_like(logits, MASKED_LOGIT)
    return out.scatter_(-1, slot_tokens, slot_logits.to(logits.dtype).expand(slot_tokens.shape).contiguous())


def draft_oracle_logits(logits: torch.Tensor, seeds, positions, alpha: float, ranks: tuple[float, ...] = (),
                        top_logit: float = TOP_LOGIT, gap: float = GAP) -> torch.Tensor:
    """Draft logits [*N, V] -> logits of the same shape and dtype (module docstring)."""
    tokens, slot_logits = draft_oracle_slots(seeds, positions, logits.shape[-1], alpha, ranks, top_logit, gap)
    return scatter_slots(logits, to_device(tokens, logits.device), to_device(slot_logits, logits.device))


@dataclass(frozen=True)
class OracleConfig:
    """alpha: the probability that the draft's top token is the target's; ranks: given a
    top-1 miss, the probabilities that it is the draft's rank 2, 3, ... token."""

    alpha: float
    ranks: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"the oracle's acceptance must be in [0, 1], got {self.alpha}")
        if any(p < 0 for p in self.ranks) or sum(self.ranks) > 1.0 + 1e-9:
            raise ValueError("the oracle's ranks are probabilities given a top-1 miss: each >= 0, summing to at most 1")

    @classmethod
    def parse(cls, values: tuple[float, ...]) -> "OracleConfig | None":
        """SpeculativeConfig.synthetic_acceptance (ALPHA, R2, R3, ...) -> config, or None when empty."""
        return cls(values[0], tuple(values[1:])) if values else None


def _seeds_positions(seqs, positions) -> tuple[np.ndarray, np.ndarray]:
    # Host arrays: the oracle hashes on the CPU and scatters once on the device.
    return np.array([s.seed for s in seqs], dtype=np.int64), np.asarray(positions, dtype=np.int64)


class TargetOracle:
    """The target half: logits predicting position t become peaked on o_t."""

    def __call__(self, logits: torch.Tensor, seqs, positions: np.ndarray) -> torch.Tensor:
        return target_oracle_logits(logits, *_seeds_positions(seqs, positions))


class DraftOracle:
    """The draft half: o_t at the draft's rank drawn from (alpha, ranks).

    `chain` makes the transforms of every step of a chain at once (they depend on (seed,
    position) only), so a step costs no host work beyond its launch. On a GPU each
    transform is one kernel that hashes and writes the rows (oracle_device.py); elsewhere
    the slots are hashed on the host and scattered.
    """

    def __init__(self, cfg: OracleConfig) -> None:
        self.alpha = cfg.alpha
        self.ranks = tuple(cfg.ranks)
        self._bounds: dict[torch.device, torch.Tensor] = {}

    def warm_up(self, device: torch.device | str, vocab: int) -> None:
        """On a GPU, compile the transform's kernel now (one launch on one row), not in the
        first forward that meets it. Nothing to do elsewhere."""
        device = torch.device(device)
        if device.type == "cuda":
            zero = torch.zeros(1, dtype=torch.int64, device=device)
            self._on_device(torch.zeros(1, vocab, device=device), zero, zero, 0)
            torch.cuda.synchronize(device)

    def __call__(self, logits: torch.Tensor, seqs, positions: np.ndarray) -> torch.Tensor:
        if logits.is_cuda:
            seeds, pos = upload_int64(_seeds_positions(seqs, positions), logits.device)
            return self._on_device(logits, seeds, pos, 0)
        return draft_oracle_logits(logits, *_seeds_positions(seqs, positions), self.alpha, self.ranks)

    def _on_device(self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, step: int):
        from spec_runtime.bench.oracle_device import draft_logits

        if logits.device not in self._bounds:
            self._bounds[logits.device] = torch.from_numpy(cumulative_bounds(self.alpha, self.ranks)).to(logits.device)
        return draft_logits(logits, seeds, positions, self._bounds[logits.device],
                            _num_slots(logits.shape[-1], self.ranks), MASKED_LOGIT, TOP_LOGIT, GAP,
                            (STREAM_ORACLE_TOKEN, STREAM_ORACLE_RANK, STREAM_ORACLE_FILL), step)

    def chain(self, seqs, positions: np.ndarray, num_steps: int, vocab: int, device, offsets=None):
        """Per-step transforms for steps 0..num_steps-1 of a chain whose step i predicts
        positions + i ([R]): a list of functions logits [R, V] -> logits. offsets: ([R] device
        values in [0, most], most): each row's positions lie that much further on (SSD forks
        chosen on the device). Off a GPU their slots are made once per (seed, position) the
        rows share (a sequence's branches), for every offset, and each row's are picked on the
        device."""
        seeds, pos = _seeds_positions(seqs, positions)
        if torch.device(device).type == "cuda":
            seeds_d, pos_d = upload_int64((seeds, pos), device)
            if offsets is not None:
                pos_d = pos_d + offsets[0]
            return [lambda logits, i=i: self._on_device(logits, seeds_d, pos_d, i) for i in range(num_steps)]
        if offsets is None:
            pos = pos[None, :] + np.arange(num_steps)[:, None]  # [steps, R]
            tokens, slot_logits = _slots(seeds[None, :], pos, vocab, self.alpha, self.ranks, TOP_LOGIT, GAP)
            tokens = to_device(torch.from_numpy(tokens), device)  # [steps, R, slots]
        else:
            rows, row_of = np.unique(np.stack([seeds, pos], 1), axis=0, return_inverse=True)  # [U, 2], [R]
            span = rows[None, :, 1] + np.arange(num_steps + offsets[1])[:, None]  # [steps + most, U]
            tokens, slot_logits = _slots(rows[None, :, 0], span, vocab, self.alpha, self.ranks, TOP_LOGIT, GAP)
            tokens, row_of = upload_int64((tokens.ravel(), row_of.ravel()), device)
            tokens = tokens.view(span.shape[0], len(rows), -1)
            steps = offsets[0][None, :] + torch.arange(num_steps, device=tokens.device)[:, None]  # [steps, R]
            tokens = tokens[steps, row_of[None, :]]  # [steps, R, slots]
        slot_logits = to_device(torch.from_numpy(slot_logits), device)
        return [lambda logits, t=tokens[i]: scatter_slots(logits, t, slot_logits) for i in range(num_steps)]


def target_oracle(values: tuple[float, ...]) -> TargetOracle | None:
    """The target's logits_transform for SpeculativeConfig.synthetic_acceptance, or None when off."""
    return TargetOracle() if OracleConfig.parse(values) is not None else None


def draft_oracle(values: tuple[float, ...]) -> DraftOracle | None:
    """The draft's logits_transform for SpeculativeConfig.synthetic_acceptance, or None when off."""
    cfg = OracleConfig.parse(values)
    return DraftOracle(cfg) if cfg is not None else None
