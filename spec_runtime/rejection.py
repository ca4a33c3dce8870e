"""Rejection sampling of a verify step: which draft tokens the target accepts, and the
recovery or bonus token after them (the vocabulary and the randomness are
spec_runtime.sampling's, where p, q and the streams are defined).

A row's draft tokens d_1..d_n are tested in order, d_i accepted with probability
min(1, p_i(d_i) / q_i(d_i)) from the uniform at (seed, position, STREAM_ACCEPT); at the
first rejection j the target samples from norm(max(0, p_j - q_j)), or after n accepts the
bonus token from p_n, both on STREAM_TARGET. Greedy rows reduce to "accept while d_i is
the argmax, then emit the argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.messages import PLACEHOLDER_TOKEN_ID
from spec_runtime.sampling import STREAM_ACCEPT, STREAM_TARGET, SamplingTensors, sample, target_probs, uniform


def _dense_q_at(j, draft, q_token_ids, q_probs, vocab: int) -> torch.Tensor:
    """q of slot j[b] of each row as a dense [B, V] float32 (zeros where there is none)."""
    b, k = draft.shape
    q = torch.zeros(b, vocab, dtype=torch.float32, device=draft.device)  # [B, V]
    if k == 0:
        return q
    jq = j.clamp(max=k - 1).unsqueeze(-1)  # [B, 1]
    if q_token_ids is None:  # deterministic draft: one-hot on its token
        return q.scatter_(-1, draft.gather(1, jq), 1.0)
    top = q_token_ids.shape[-1]
    ids = q_token_ids.gather(1, jq.unsqueeze(-1).expand(b, 1, top)).squeeze(1)  # [B, top_k_q]
    probs = q_probs.gather(1, jq.unsqueeze(-1).expand(b, 1, top)).squeeze(1).float()  # [B, top_k_q]
    # scatter_add: padded ids (-1) add 0 at id 0; repeated ids add up.
    return q.scatter_add_(-1, ids.clamp(min=0), probs * (ids >= 0))


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verify step for a batch."""

    num_accepted: torch.Tensor  # [B] int64, j
    output_token_ids: torch.Tensor  # [B, K+1] int64: d_1..d_j, then recovery/bonus, then -1
    num_output: torch.Tensor  # [B] int64, j + 1
    last_token_ids: torch.Tensor  # [B] int64: the recovery or bonus token


def _check_verify_shapes(target_logits, draft_token_ids, q_token_ids, q_probs, st: SamplingTensors) -> None:
    b, s, vocab = target_logits.shape
    k = s - 1
    if draft_token_ids.shape != (b, k) or st.batch_size != b:
        raise ValueError(f"draft_token_ids {tuple(draft_token_ids.shape)} or {st.batch_size} "
                         f"sampling rows do not match target_logits {(b, s, vocab)}")
    if (q_token_ids is None) != (q_probs is None) or (
        q_token_ids is not None and (q_token_ids.shape[:2] != (b, k) or q_probs.shape != q_token_ids.shape)
    ):
        raise ValueError(f"q_token_ids and q_probs must both be None or both [{b}, {k}, top_k_q]")


def _accept_sampled(probs_k: torch.Tensor, draft: torch.Tensor, q_token_ids: torch.Tensor | None,
                    q_probs: torch.Tensor | None, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """The sampled rows' rule, u < p(d_i) / q(d_i), per draft token: [B, K] bool.
    probs_k: the target's probabilities at the K draft slots [B, K, V]."""
    b, k = draft.shape
    p_draft = probs_k.gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if q_token_ids is None:
        q_draft = torch.ones_like(p_draft)  # deterministic draft: q one-hot on d_i
    else:
        q_draft = ((q_token_ids == draft.unsqueeze(-1)) * q_probs).sum(-1)  # [B, K]
    seeds_k = st.seed.unsqueeze(-1).expand(b, k)  # [B, K]
    slot = torch.arange(k, device=draft.device)  # [K]
    u = uniform(seeds_k, positions.unsqueeze(-1) + slot, STREAM_ACCEPT,
                torch.zeros(1, dtype=torch.int64, device=draft.device)).squeeze(-1)  # [B, K]
    # u < p/q without dividing: q >= p always accepts (u < 1); p = 0 never does.
    return u * q_draft < p_draft  # [B, K]


def _recovery_or_bonus(probs: torch.Tensor, j: torch.Tensor, n: torch.Tensor, draft: torch.Tensor,
                       q_token_ids: torch.Tensor | None, q_probs: torch.Tensor | None, st: SamplingTensors,
                       positions: torch.Tensor) -> torch.Tensor:
    """The sampled rows' token at slot j: from the residual max(p - q, 0) after a
    rejection (j < n), from p itself after a full accept (the bonus). [B] int64."""
    b, _, vocab = probs.shape
    p_j = probs.gather(1, j.view(b, 1, 1).expand(b, 1, vocab)).squeeze(1)  # [B, V]
    rejected = (j < n).unsqueeze(-1)  # [B, 1] recovery (else bonus: q counts as 0)
    q_j = _dense_q_at(j, draft, q_token_ids, q_probs, vocab)  # [B, V]
    residual = torch.clamp(p_j - q_j * rejected, min=0.0)  # [B, V]
    empty = residual.sum(-1, keepdim=True) <= 0.0  # [B, 1] p == q numerically
    residual = torch.where(empty, p_j, residual)
    return sample(residual, st.seed, positions + j, STREAM_TARGET)  # [B]


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    q_token_ids: torch.Tensor | None,
    q_probs: torch.Tensor | None,
    st: SamplingTensors,
    positions: torch.Tensor,
) -> VerifyResult:
    """Verify a batch of draft chains against the target (see the module docstring).

    target_logits: [B, K+1, V]; draft_token_ids: [B, K] (-1 past each row's drafts);
    num_draft_tokens: [B] in 0..K; q_token_ids, q_probs: [B, K, top_k_q] or both None;
    positions: [B] position of d_1 (slot i is position positions + i).
    """
    _check_verify_shapes(target_logits, draft_token_ids, q_token_ids, q_probs, st)
    b, s, vocab = target_logits.shape
    k = s - 1
    device = target_logits.device
    slot = torch.arange(s, device=device)  # [K+1]
    n = num_draft_tokens.clamp(0, k)  # [B]
    draft = draft_token_ids.clamp(min=0)  # [B, K] padding -> 0, masked by has_draft
    has_draft = slot[:k] < n.unsqueeze(-1)  # [B, K]
    argmax = torch.argmax(target_logits, dim=-1)  # [B, K+1] greedy rows' tokens

    accept = draft == argmax[:, :k]  # [B, K] greedy rule
    probs = None
    if not st.all_greedy:
        probs = target_probs(target_logits, st)  # [B, K+1, V]
        accept_sampled = _accept_sampled(probs[:, :k], draft, q_token_ids, q_probs, st, positions)  # [B, K]
        accept = torch.where(st.is_greedy.unsqueeze(-1), accept, accept_sampled)
    accept = accept & has_draft
    num_accepted = torch.cumprod(accept.long(), dim=-1).sum(-1)  # [B]

    j = num_accepted  # [B] slot of the recovery/bonus token
    last = argmax.gather(1, j.unsqueeze(-1)).squeeze(-1)  # [B]
    if probs is not None:
        sampled = _recovery_or_bonus(probs, j, n, draft, q_token_ids, q_probs, st, positions)  # [B]
        last = torch.where(st.is_greedy, last, sampled)

    j_col = j.unsqueeze(-1)  # [B, 1]
    draft_ext = torch.nn.functional.pad(draft_token_ids.long(), (0, 1), value=PLACEHOLDER_TOKEN_ID)
    out = torch.where(slot < j_col, draft_ext, PLACEHOLDER_TOKEN_ID)
    out = torch.where(slot == j_col, last.unsqueeze(-1), out)  # [B, K+1]
    return VerifyResult(num_accepted, out, j + 1, last)

