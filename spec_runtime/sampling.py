"""Exact sampling for speculative decoding: pure, vectorized, sync-free torch functions.

Vocabulary (used the same way in the whole runtime):
  p          the target's distribution at one position: its logits after the request's
             temperature, then min-p, then top-k, then top-p, renormalized; one-hot on the
             argmax of the logits for greedy rows (temperature 0). Logit processors that
             depend on the sequence (penalties, logit bias, min_tokens:
             spec_runtime.logits_process) are applied to the logits before they get here.
  q          the distribution a draft token was *actually* sampled from: the draft's
             logits after its temperature/top-k/top-p, truncated to its top `top_k_q`
             tokens, renormalized, optionally Saguaro-rescaled. It travels sparse as
             (q_token_ids, q_probs). q = None means the draft tokens were chosen
             deterministically (greedy draft, n-gram lookup): q is one-hot on each token.
  accepted   draft token d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
             the first rejection ends the round. num_accepted = j (0..n, n =
             num_draft_tokens of the row) is the length of the accepted prefix.
  recovered  at the first rejection (j < n) the target samples the recovery token from
             norm(max(0, p_j - q_j)), or from p_j where that is all zero (p == q).
  bonus      when all n draft tokens are accepted (j == n) the target samples the bonus
             token from p_n. n = 0 is plain autoregressive decoding of one token.
  A round outputs j + 1 tokens: the accepted draft tokens, then the recovery/bonus token
  (spec_runtime.rejection runs that test).
  Greedy rows accept while d_i == argmax and then emit the argmax: given the same
  logits, the same tokens, bit for bit, as greedy decoding without a draft.

Positions: a token's position is its index in the sequence, prompt included. In a
verify, slot i of target_logits [B, K+1, V] is the distribution of the token at
positions + i, where positions [B] is the position of draft token d_1.

Randomness is counter-based: every uniform is a pure function of (request seed,
position, stream, index), hashed with integer ops on int64 tensors. So output depends
on the seed alone (not on batch composition, nor on whether a speculation came from a
cache), there is no per-request torch.Generator, and nothing syncs with the host.
Streams keep the three uses independent: STREAM_DRAFT (the draft's sample at that
position, index = token id), STREAM_ACCEPT (the accept test, index 0) and STREAM_TARGET
(the target's own sample: AR, recovery and bonus tokens, index = token id). The token
at position t depends only on the uniforms at t and on the tokens before it, which
is why exactness survives rounds that revisit a position (what a round computes past
its first rejection never reaches the output).

Sampling a token from weights w >= 0 (need not sum to 1) is an exponential race:
argmax_v w_v / E_v with E_v = -log(u_v) i.i.d. Exp(1) picks v with probability
w_v / sum(w) exactly (up to the 2**-32 grain of the uniforms); it is order-free and
needs no normalization or host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_TARGET = 3
# Temperatures below this are greedy (dividing by them would overflow the logits).
GREEDY_TEMPERATURE = 1e-5

_M32 = 0xFFFFFFFF
# Multipliers stay below 2**31: for x < 2**32 every product is < 2**63, so the int64
# arithmetic never overflows and CPU and CUDA give identical bits.
_MUL = 0x045D9F3B
_WEYL = 0x61C88647  # 2**32 / golden ratio, odd: a Weyl step over the index.


def _mix32(x):
    """A bijective 32-bit integer mixer on int64 tensors (or Python ints) in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def stream_key(stream: int) -> int:
    """A stream's key, mixed into every row key of hash32 (a Python int: no device op)."""
    return _mix32(((stream + 1) * _WEYL) & _M32)


def hash32(seeds: torch.Tensor, positions: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """32-bit hash of (seed, position, stream, index) as int64 in [0, 2**32).

    seeds, positions: [*R] int64 (any int64 seed; positions < 2**32).
    index: [*R, M] or [M] int64. Returns [*R, M] int64.
    The row key and the index are mixed separately (index [M] costs [M], not [*R, M]),
    then one mix per element: for a row, distinct indices give distinct values.
    NumPy int64 arrays give the same bits in NumPy (the benchmark oracle hashes on the host).
    """
    if isinstance(seeds, torch.Tensor):
        seeds, positions, index = seeds.long(), positions.long(), index.long()
    # Few ops on purpose: on CUDA these small kernels are launch-bound.
    key = _mix32((seeds & _M32) ^ stream_key(stream))  # [*R] low word (two's complement)
    # High word and position share one step: (hi + pos * W) mod 2**32.
    key = _mix32(key ^ ((((seeds >> 32) & _M32) + (positions & _M32) * _WEYL) & _M32))
    index_mixed = _mix32(((index & _M32) * _WEYL + 0x68E31DA4) & _M32)  # [*R, M] or [M]
    return _mix32(index_mixed ^ key[..., None])  # [*R, M]


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in the open interval (0, 1): [*R] x [*R, M] -> [*R, M] float64 (on CUDA one
    kernel, spec_runtime.kernels.race.uniforms, with the same bits)."""
    if seeds.is_cuda:
        from spec_runtime.kernels.race import uniforms

        seeds, positions = torch.broadcast_tensors(seeds, positions)
        return uniforms(seeds, positions, stream_key(stream), index)
    return uniform_torch(seeds, positions, stream, index)


def warm_up_kernels(device: torch.device, vocab_size: int, top_k_q: int) -> float:
    """Compile the sampling kernels (spec_runtime.kernels.race) on a CUDA device before
    serving, with the streams' keys serving passes; returns the seconds it took."""
    import time

    from spec_runtime.kernels.race import warm_up

    t0 = time.perf_counter()
    warm_up(device, vocab_size, top_k_q, stream_key(STREAM_TARGET), stream_key(STREAM_ACCEPT),
            stream_key(STREAM_DRAFT))
    return time.perf_counter() - t0


def uniform_torch(seeds: torch.Tensor, positions: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """`uniform` in torch ops, on any device."""
    return hash_to_unit(hash32(seeds, positions, stream, index))


def hash_to_unit(h):
    """hash32's values -> the open interval (0, 1) in float64; a NumPy array gives the same
    bits as a tensor (the benchmark oracle hashes on the host)."""
    h = h.to(torch.float64) if isinstance(h, torch.Tensor) else h.astype(float)
    # float64 holds (2**32 - 0.5) / 2**32 exactly, so u < 1 and -log(u) > 0.
    return (h + 0.5) * (1.0 / 4294967296.0)


def _exponential(seeds, positions, stream: int, index: torch.Tensor) -> torch.Tensor:
    """E = -log(u) ~ Exp(1): [*R] x [*R, M] -> [*R, M] float32 (>= 1.1e-10)."""
    h = hash32(seeds, positions, stream, index)
    return torch.log((h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)).neg_().to(torch.float32)


def sample(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           stream: int = STREAM_TARGET, is_logits: bool = False) -> torch.Tensor:
    """Sample one token per row by exponential race: [B, V] -> [B] int64.

    weights: probabilities or any nonnegative weights (rows need not sum to 1), or
    logits when is_logits (then argmax(logits - log E) = argmax(softmax / E)).
    The race at (seed, position, stream) uses index = token id.
    """
    if weights.dim() != 2:
        raise ValueError(f"sample expects [B, V], got {tuple(weights.shape)}")
    if weights.is_cuda and not is_logits:  # one kernel instead of dozens over [B, V] int64 tensors
        from spec_runtime.kernels.race import dense_race

        return dense_race(weights, seeds, positions, stream_key(stream))
    return sample_torch(weights, seeds, positions, stream, is_logits)


def sample_torch(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int = STREAM_TARGET,
                 is_logits: bool = False) -> torch.Tensor:
    """`sample` in torch ops, on any device."""
    vocab_ids = torch.arange(weights.shape[-1], device=weights.device)  # [V]
    e = _exponential(seeds, positions, stream, vocab_ids)  # [B, V]
    if is_logits:
        return torch.argmax(weights.float() - torch.log(e), dim=-1)
    return torch.argmax(weights.float() / e, dim=-1)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host-side flags.

    The flags come from the Python params, so kernels a batch does not need (sorting
    for top-k/top-p, softmax for an all-greedy batch) are skipped without a sync.
    """

    temperature: torch.Tensor  # [B] float32 (0 for greedy rows)
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    seed: torch.Tensor  # [B] int64
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None  # [B] float32, 0 = off; None when no row uses it
    any_min_p: bool = False

    @classmethod
    def from_params(cls, params: Sequence[tuple[float, int, float, int]],
                    device: torch.device | str = "cpu", min_p: Sequence[float] | None = None) -> "SamplingTensors":
        """params: one (temperature, top_k, top_p, seed) per row; min_p: one per row (None: off)."""
        if not params:
            raise ValueError("from_params needs at least one row")
        temps, top_ks, top_ps, seeds = [], [], [], []
        for temperature, top_k, top_p, seed in params:
            if not temperature >= 0.0:
                raise ValueError(f"temperature must be >= 0, got {temperature}")
            if top_k < 0:
                raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
            if not 0.0 < top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {top_p}")
            temps.append(float(temperature)), top_ks.append(int(top_k)), top_ps.append(float(top_p))
            seeds.append((int(seed) + (1 << 63)) % (1 << 64) - (1 << 63))  # any int, as a signed int64
        greedy = [t < GREEDY_TEMPERATURE for t in temps]
        min_ps = [float(m) for m in min_p] if min_p is not None else [0.0] * len(temps)
        if len(min_ps) != len(temps) or not all(0.0 <= m <= 1.0 for m in min_ps):
            raise ValueError(f"min_p must hold one value in [0, 1] per row, got {min_ps}")
        any_min_p = any(m > 0.0 and not g for m, g in zip(min_ps, greedy))
        # Two uploads, not one per field: each copy from pageable memory waits for the device.
        floats = to_device(torch.tensor([temps, top_ps, min_ps], dtype=torch.float32), device)  # [3, B]
        ints = to_device(torch.tensor([top_ks, seeds, greedy], dtype=torch.int64), device)  # [3, B]
        return cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            seed=ints[1],
            is_greedy=ints[2].bool(),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k > 0 and not g for k, g in zip(top_ks, greedy)),
            any_top_p=any(p < 1.0 and not g for p, g in zip(top_ps, greedy)),
            min_p=floats[2] if any_min_p else None,
            any_min_p=any_min_p,
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    def repeat_rows(self, n: int) -> "SamplingTensors":
        """Each row n times in a row: the params of a flattened [B, n, V] -> [B * n, V]."""
        rep = lambda t: t.repeat_interleave(n, dim=0)  # noqa: E731
        return SamplingTensors(
            rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.seed),
            rep(self.is_greedy), self.all_greedy, self.any_greedy, self.any_top_k, self.any_top_p,
            rep(self.min_p) if self.min_p is not None else None, self.any_min_p,
        )


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device` (t itself if already there); from host memory to a GPU through pinned
    memory without a stream sync (a pageable copy would wait for the GPU)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _mask_top_k_top_p(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    scaled: [B, V] temperature-scaled logits. Ties are broken by token id (stable sort),
    so the kept set of a row does not depend on the rest of the batch.
    """
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=scaled.device)  # [V]
    if st.any_top_k:
        k = torch.where(st.top_k > 0, st.top_k, vocab)  # [B]
        sorted_logits = sorted_logits.masked_fill(rank >= k.unsqueeze(-1), float("-inf"))
    if st.any_top_p:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        # Keep a token iff the mass ranked strictly above it is < top_p: the smallest
        # set with mass >= top_p; rank 0 (mass 0 above it) always stays.
        mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [B, V]
        drop = (mass_above >= st.top_p.unsqueeze(-1)) & (st.top_p < 1.0).unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """p: [B, V] or [B, S, V] logits -> float32 probabilities of the same shape.

    Temperature, then min-p, then top-k, then top-p, renormalized; greedy rows are one-hot
    on the argmax of the logits. Row b of a [B, S, V] input uses the params of row b.
    """
    if logits.dim() == 3:
        b, s, v = logits.shape
        return target_probs(logits.reshape(b * s, v), st.repeat_rows(s)).view(b, s, v)
    if logits.dim() != 2 or logits.shape[0] != st.batch_size:
        raise ValueError(f"logits {tuple(logits.shape)} do not match batch {st.batch_size}")
    vocab = logits.shape[-1]
    if st.all_greedy:
        return _one_hot(torch.argmax(logits, dim=-1), vocab)
    temperature = torch.where(st.is_greedy, 1.0, st.temperature)  # [B]
    scaled = logits.float() / temperature.unsqueeze(-1)  # [B, V]
    if st.any_min_p:
        # min-p keeps tokens with prob >= min_p * max prob, i.e. scaled >= max + log(min_p)
        # (log 0 = -inf keeps every token of a row without min-p).
        floor = scaled.amax(-1, keepdim=True) + torch.log(st.min_p).unsqueeze(-1)  # [B, 1]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if st.any_top_k or st.any_top_p:
        scaled = _mask_top_k_top_p(scaled, st)
    probs = torch.softmax(scaled, dim=-1)  # [B, V]
    if st.any_greedy:
        greedy = _one_hot(torch.argmax(logits, dim=-1), vocab)
        probs = torch.where(st.is_greedy.unsqueeze(-1), greedy, probs)
    return probs


def _one_hot(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[*] int64 -> [*, V] float32."""
    out = torch.zeros(*token_ids.shape, vocab, dtype=torch.float32, device=token_ids.device)
    return out.scatter_(-1, token_ids.unsqueeze(-1), 1.0)


def saguaro_rescale(
    q_probs: torch.Tensor, fan_out_f: int | torch.Tensor, factor: float
) -> torch.Tensor:
    """Saguaro sampling (SSD paper): scale the draft's top-F probabilities by `factor`
    and renormalize.

    q_probs: [B, k] (or [B, K, k]) sorted descending, as draft_sample returns them.
    fan_out_f: F, an int or a [B] tensor. factor < 1 moves draft mass toward the tail,
    so the residual max(0, p - q) at a rejection concentrates on the top-F tokens the
    tree cache has branches for. It is a deterministic transform of q: the draft samples
    from the rescaled q and sends it, and verification uses the same q, so acceptance
    stays exact. If all of q's mass lies in the top F, it is unchanged.
    """
    if not factor > 0.0:
        raise ValueError(f"saguaro factor must be > 0, got {factor}")
    k = q_probs.shape[-1]
    rank = torch.arange(k, device=q_probs.device)  # [k]
    if isinstance(fan_out_f, torch.Tensor):
        f = fan_out_f.reshape(-1, *([1] * (q_probs.dim() - 1)))  # [B, 1(, 1)]
    else:
        f = fan_out_f
    scaled = q_probs * torch.where(rank < f, factor, 1.0)  # [B, (K,) k]
    return scaled / scaled.sum(-1, keepdim=True)


def _truncated_q(logits: torch.Tensor, st: SamplingTensors, top_k_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's top_k_q tokens and their renormalized probabilities: [B, k] int64 ids in
    descending q, [B, k] float32 (greedy rows ranked by their logits; draft_sample makes
    their q one-hot)."""
    if st.any_top_p or st.any_min_p:
        rank_by = target_probs(logits, st)  # [B, V]: the nucleus needs the whole distribution
        if st.any_greedy:
            rank_by = torch.where(st.is_greedy.unsqueeze(-1), torch.softmax(logits.float(), -1), rank_by)
        top_probs, q_token_ids = torch.topk(rank_by, top_k_q, dim=-1)  # [B, k]
        return q_token_ids, top_probs / top_probs.sum(-1, keepdim=True)
    # Temperature and softmax keep the logits' order, and the renormalized top k of
    # softmax(l / T) is the softmax of the top k of l / T: one pass over the vocabulary.
    top_logits, q_token_ids = torch.topk(logits, top_k_q, dim=-1)  # [B, k]
    scaled = top_logits.float() / torch.where(st.is_greedy, 1.0, st.temperature).unsqueeze(-1)
    if st.any_top_k:
        keep = torch.where(st.top_k > 0, st.top_k, top_k_q)  # [B]
        scaled = scaled.masked_fill(torch.arange(top_k_q, device=logits.device) >= keep.unsqueeze(-1), float("-inf"))
    return q_token_ids, torch.softmax(scaled, dim=-1)


def draft_sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    positions: torch.Tensor,
    top_k_q: int,
    rescale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample the draft's token and return the sparse q it was sampled from.

    logits: [B, V] draft logits; st: the draft's params (its temperature may differ
    from the request's, the seed must be the request's); positions: [B] position of
    the token being sampled. rescale: e.g. partial(saguaro_rescale, fan_out_f=3,
    factor=0.5), applied to the sorted truncated q before sampling.
    Returns token_ids [B], q_token_ids [B, top_k_q] (descending q), q_probs [B, top_k_q].
    Greedy rows: token = argmax, q one-hot on it.
    """
    if not 1 <= top_k_q <= logits.shape[-1]:
        raise ValueError(f"top_k_q must be in [1, vocab={logits.shape[-1]}], got {top_k_q}")
    q_token_ids, q_probs = _truncated_q(logits, st, top_k_q)
    if st.any_greedy:
        greedy = st.is_greedy.unsqueeze(-1)  # [B, 1]
        first = torch.arange(top_k_q, device=logits.device) == 0  # [k]
        q_probs = torch.where(greedy, first.float(), q_probs)
        # argmax, not topk's pick among ties: the greedy token is the first maximum.
        q_token_ids = torch.where(greedy & first, torch.argmax(logits, -1, keepdim=True), q_token_ids)
    if rescale is not None:
        q_probs = rescale(q_probs)
    # Race keyed by token id, so the draw does not depend on the order topk returns.
    if q_token_ids.is_cuda:  # one kernel instead of several dozen launches per draft token
        from spec_runtime.kernels.race import draft_race

        return draft_race(st.seed, positions, stream_key(STREAM_DRAFT), q_token_ids, q_probs), q_token_ids, q_probs
    return draft_race_torch(st.seed, positions, STREAM_DRAFT, q_token_ids, q_probs), q_token_ids, q_probs


def draft_race_torch(seeds: torch.Tensor, positions: torch.Tensor, stream: int, q_token_ids: torch.Tensor,
                     q_probs: torch.Tensor) -> torch.Tensor:
    """The exponential race over each row's q: [R] int64, the token of argmax q / E
    (spec_runtime.kernels.race.draft_race is the same in one CUDA kernel)."""
    e = _exponential(seeds, positions, stream, q_token_ids)  # [R, M]
    choice = torch.argmax(q_probs / e, dim=-1, keepdim=True)  # [R, 1]
    return q_token_ids.gather(-1, choice).squeeze(-1)  # [R]
