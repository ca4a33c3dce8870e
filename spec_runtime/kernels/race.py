"""Triton kernels for the counter-based randomness of spec_runtime.sampling on CUDA.

`spec_runtime.sampling.draft_sample` picks the draft token from its truncated q by an
exponential race keyed by (seed, position, STREAM_DRAFT, token id): argmax q / E with
E = -log(u), u from the counter-based hash (`sampling.hash32`). In torch that is several
dozen elementwise kernels per draft token, each launched from the host between the graph
replays of a chain, and a sampled chain is then host-bound (docs/benchmarks.md, "Plain
steps that keep the draft current"). `draft_race` does the same integer and float
operations in one program per row: the same bits for E (int64 hash, float64 log, then
float32), the same first-maximum rule as torch.argmax.

The target's sampling does the same over the whole vocabulary (`dense_race`: the
recovery, bonus and plain-decode tokens at temperature > 0) and draws the accept test's
uniforms (`uniforms`); in torch each is again several dozen kernels, the race's over
[B, V] int64 tensors, launched between the verify's forward and its result copy while
the GPU waits. Both give the bits of the torch functions they replace.

Triton compiles a kernel once per specialization of its arguments: a pointer aligned to
16 bytes or not, an integer divisible by 16 or equal to 1. The per-row parameters are
views (a batch's seeds lie B int64s into one upload: aligned at even B only), and the
element counts follow the batch, so each kernel would be compiled again at the first
batch of another parity or size class, in the middle of serving (on an H100 host the first
plain step at 3 sequences, after steps at 4, took 0.76 s, which a compile would explain;
not profiled). Those arguments are not specialized (`do_not_specialize`,
`do_not_specialize_on_alignment`): one compiled kernel serves every batch. The race's weights and the outputs, whose loads and stores are
the kernels' bulk, stay specialized; they are fresh allocations, always aligned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = (((x >> 16) ^ x) * 0x045D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x045D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _row_key(seed, pos, stream_key):
    key = _mix32((seed & 0xFFFFFFFF) ^ stream_key)
    return _mix32(key ^ ((((seed >> 32) & 0xFFFFFFFF) + (pos & 0xFFFFFFFF) * 0x61C88647) & 0xFFFFFFFF))


@triton.jit
def _unit(key, index):
    """(hash + 0.5) / 2**32 in float64: sampling.uniform's value for one (row key, index)."""
    h = _mix32(_mix32(((index & 0xFFFFFFFF) * 0x61C88647 + 0x68E31DA4) & 0xFFFFFFFF) ^ key)
    return (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)


@triton.jit(do_not_specialize=["m", "stream_key"],
            do_not_specialize_on_alignment=["seed_ptr", "pos_ptr", "ids_ptr", "probs_ptr"])
def _draft_race_kernel(seed_ptr, pos_ptr, ids_ptr, probs_ptr, out_ptr, m, stream_key, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    key = _row_key(tl.load(seed_ptr + r), tl.load(pos_ptr + r), stream_key)
    offs = tl.arange(0, BLOCK)
    mask = offs < m
    ids = tl.load(ids_ptr + r * m + offs, mask=mask, other=0)
    q = tl.load(probs_ptr + r * m + offs, mask=mask, other=0.0)
    e = (-tl.log(_unit(key, ids))).to(tl.float32)
    score = tl.where(mask, q / e, -1.0)
    best = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(out_ptr + r, tl.sum(tl.where(offs == best, ids, 0), axis=0))


def draft_race(seeds: torch.Tensor, positions: torch.Tensor, stream_key: int, q_token_ids: torch.Tensor,
               q_probs: torch.Tensor) -> torch.Tensor:
    """The token each row's race picks: seeds, positions [R] int64, q_token_ids [R, M]
    int64, q_probs [R, M] float32 -> [R] int64, as sampling.draft_race_torch with the
    stream whose key (sampling.stream_key) is stream_key."""
    grid, args, meta = draft_race_args(seeds, positions, stream_key, q_token_ids, q_probs)
    if grid[0]:
        _draft_race_kernel[grid](*args, **meta)
    return args[4]


def draft_race_args(seeds, positions, stream_key: int, q_token_ids, q_probs) -> tuple[tuple, tuple, dict]:
    """draft_race's launch: grid, arguments (the output [R] fifth) and constexprs."""
    r, m = q_token_ids.shape
    out = torch.empty(r, dtype=torch.int64, device=q_token_ids.device)
    args = (seeds.long().contiguous(), positions.long().contiguous(), q_token_ids.contiguous(),
            q_probs.float().contiguous(), out, m, stream_key)
    return (r,), args, dict(BLOCK=triton.next_power_of_2(m))


@triton.jit(do_not_specialize=["stream_key"], do_not_specialize_on_alignment=["seed_ptr", "pos_ptr"])
def _dense_race_kernel(w_ptr, seed_ptr, pos_ptr, score_ptr, idx_ptr, vocab, num_chunks, stream_key,
                       CHUNK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    key = _row_key(tl.load(seed_ptr + r), tl.load(pos_ptr + r), stream_key)
    ids = c * CHUNK + tl.arange(0, CHUNK)
    mask = ids < vocab
    w = tl.load(w_ptr + r.to(tl.int64) * vocab + ids, mask=mask, other=0.0)
    e = (-tl.log(_unit(key, ids.to(tl.int64)))).to(tl.float32)
    score = tl.where(mask, w / e, -1.0)
    best = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(score_ptr + r * num_chunks + c, tl.max(score, axis=0))
    tl.store(idx_ptr + r * num_chunks + c, c * CHUNK + best.to(tl.int64))


def dense_race(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream_key: int,
               chunk: int = 4096) -> torch.Tensor:
    """argmax_v weights[r, v] / E(seed r, position r, stream, v) per row, the first maximum:
    weights [R, V] (>= 0), seeds, positions [R] int64 -> [R] int64, as sampling.sample
    (weights, not logits). Each program races one chunk of a row; the chunks' winners are
    compared after, the first of equal ones kept, so ties go to the lowest token id."""
    if weights.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=weights.device)
    grid, args, meta = dense_race_args(weights, seeds, positions, stream_key, chunk)
    _dense_race_kernel[grid](*args, **meta)
    scores, idx = args[3], args[4]
    return idx.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)


def dense_race_args(weights, seeds, positions, stream_key: int, chunk: int = 4096) -> tuple[tuple, tuple, dict]:
    """dense_race's launch: grid, arguments (each chunk's best score and token fourth and
    fifth, [R, chunks]) and constexprs."""
    r, vocab = weights.shape
    num_chunks = triton.cdiv(vocab, chunk)
    scores = torch.empty(r, num_chunks, dtype=torch.float32, device=weights.device)
    idx = torch.empty(r, num_chunks, dtype=torch.int64, device=weights.device)
    args = (weights.float().contiguous(), seeds.long().contiguous(), positions.long().contiguous(), scores, idx,
            vocab, num_chunks, stream_key)
    return (r, num_chunks), args, dict(CHUNK=chunk)


@triton.jit(do_not_specialize=["total", "m", "index_stride", "stream_key"],
            do_not_specialize_on_alignment=["seed_ptr", "pos_ptr", "index_ptr"])
def _uniform_kernel(seed_ptr, pos_ptr, index_ptr, out_ptr, total, m, index_stride, stream_key, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < total
    r = e // m
    i = e % m
    key = _row_key(tl.load(seed_ptr + r, mask=mask, other=0), tl.load(pos_ptr + r, mask=mask, other=0), stream_key)
    index = tl.load(index_ptr + r * index_stride + i, mask=mask, other=0)
    tl.store(out_ptr + e, _unit(key, index), mask=mask)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream_key: int, index: torch.Tensor) -> torch.Tensor:
    """sampling.uniform in one kernel: seeds, positions [*R] int64 (one shape); index [*R, M]
    or [M] int64 -> [*R, M] float64 in (0, 1)."""
    grid, args, meta = uniforms_args(seeds, positions, stream_key, index)
    if grid[0]:
        _uniform_kernel[grid](*args, **meta)
    return args[3].view(*seeds.shape, index.shape[-1])


def uniforms_args(seeds, positions, stream_key: int, index) -> tuple[tuple, tuple, dict]:
    """uniforms' launch: grid, arguments (the flat output fourth) and constexprs."""
    m = index.shape[-1]
    seeds, positions = seeds.long().reshape(-1).contiguous(), positions.long().reshape(-1).contiguous()
    shared = index.dim() == 1
    index = index.long().contiguous() if shared else index.long().reshape(-1, m).contiguous()
    out = torch.empty(seeds.shape[0] * m, dtype=torch.float64, device=seeds.device)
    block = 256
    args = (seeds, positions, index, out, out.numel(), m, 0 if shared else m, stream_key)
    return (triton.cdiv(out.numel(), block),), args, dict(BLOCK=block)


def warm_up_launches(device, vocab_size: int, top_k_q: int, target_key: int, accept_key: int,
                     draft_key: int) -> list[tuple]:
    """One launch of each kernel as serving makes it (kernel, grid, arguments, constexprs),
    over two rows: the recovery/bonus race over the vocabulary (target_key), the accept
    test's uniforms over [B, K] with the shared index 0 (accept_key), and the draft's race
    over its top_k_q tokens (draft_key). Integer arguments are typed by their value range
    (int32 or int64), so the keys must be the ones serving passes."""
    seeds = torch.tensor([11, 12], dtype=torch.int64, device=device)
    positions = torch.tensor([5, 6], dtype=torch.int64, device=device)
    weights = torch.rand(2, vocab_size, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    q_ids = torch.arange(2 * top_k_q, device=device).view(2, top_k_q) % vocab_size
    return [(_dense_race_kernel, *dense_race_args(weights, seeds, positions, target_key)),
            (_uniform_kernel, *uniforms_args(seeds[:, None].expand(2, 2), positions[:, None] + torch.arange(
                2, device=device), accept_key, index)),
            (_draft_race_kernel, *draft_race_args(seeds, positions, draft_key, q_ids, torch.rand(2, top_k_q,
                                                                                                   device=device)))]


def warm_up(device, vocab_size: int, top_k_q: int, target_key: int, accept_key: int, draft_key: int) -> None:
    """Compile (or load from Triton's cache) every kernel here now: the first call of each
    would otherwise stop the first step that needs it for the compile, hundreds of
    milliseconds on a GPU host (the first verify with drafts at temperature > 0, the first
    sampled draft token)."""
    for kernel, grid, args, meta in warm_up_launches(device, vocab_size, top_k_q, target_key, accept_key, draft_key):
        kernel[grid](*args, **meta)
    torch.cuda.synchronize(device)
