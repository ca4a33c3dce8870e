"""Logit processors that depend on a sequence's tokens: logit bias, min_tokens, and the
repetition, frequency and presence penalties, with vLLM's definitions and order; and the
logprobs reported to clients (`token_logprobs`).

They act on the target's logits before rejection sampling (spec_runtime.sampling), so the
distribution the sampler verifies against, greedy argmax included, is the processed one.
The draft's q stays what it is, a proposal: acceptance with min(1, p / q) and recovery
from norm(max(0, p - q)) give exactly the processed p, whatever q is.

In a verify over [x_n, d_1..d_K], slot i predicts the token that follows d_1..d_i, so
each slot counts the committed tokens plus d_1..d_i. Slots past the first rejection are
never used, so counting drafts that end up rejected changes nothing.

Order, as in vLLM's sampler: logit bias, the min_tokens mask (EOS and stop token ids
while fewer than min_tokens tokens are generated), the repetition penalty (over prompt
and output tokens: positive logits divided by it, negative ones multiplied), then the
frequency penalty (times each output token's count) and the presence penalty (once per
output token seen). Temperature, min-p, top-k and top-p follow in target_probs.
A row that uses none of them passes through bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.messages import SamplingParams


def needs_processing(sp: SamplingParams) -> bool:
    return bool(sp.logit_bias or sp.min_tokens or sp.presence_penalty or sp.frequency_penalty
                or sp.repetition_penalty != 1.0)


def _counts(lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row's list."""
    width = max((len(x) for x in lists), default=0)
    ids = torch.full((len(lists), max(width, 1)), vocab, dtype=torch.int64)
    for i, x in enumerate(lists):
        if x:
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.int64)
    ids = ids.to(device, non_blocking=True)
    # Padding counts into an extra column that is dropped.
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab]


@dataclass(frozen=True)
class LogitsProcess:
    """The processors of one batch, on the device. Build with `build`; apply with `apply`."""

    bias: torch.Tensor | None  # [B, V] float32
    blocked: torch.Tensor | None  # [B, V] bool: ids that min_tokens masks
    num_output: torch.Tensor  # [B] int64 tokens generated before slot 0
    min_tokens: torch.Tensor  # [B] int64
    output_counts: torch.Tensor | None  # [B, V] float32 (None: no penalty in the batch)
    prompt_seen: torch.Tensor | None  # [B, V] bool (None: no repetition penalty)
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
              num_prompt_tokens: Sequence[int], eos_token_ids: Sequence[int], vocab: int,
              device) -> "LogitsProcess | None":
        """Per row: its params, its tokens (prompt then output) and its prompt length.
        None when no row needs processing (the caller then skips `apply`)."""
        if not any(needs_processing(sp) for sp in params):
            return None
        b = len(params)
        outputs = [list(t[n:]) for t, n in zip(token_ids, num_prompt_tokens)]
        num_output = [len(o) for o in outputs]

        def row_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        bias = None
        if any(sp.logit_bias for sp in params):
            bias = torch.zeros(b, vocab, dtype=torch.float32)
            for i, sp in enumerate(params):
                for t, v in sp.logit_bias.items():
                    bias[i, int(t)] = float(v)
            bias = bias.to(device, non_blocking=True)
        blocked = None
        if any(sp.min_tokens > n for sp, n in zip(params, num_output)):
            blocked = torch.zeros(b, vocab, dtype=torch.bool)
            for i, sp in enumerate(params):
                stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
                blocked[i, [t for t in stops if 0 <= t < vocab]] = True
            blocked = blocked.to(device, non_blocking=True)
        any_penalty = any(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                          for sp in params)
        any_repetition = any(sp.repetition_penalty != 1.0 for sp in params)
        return cls(
            bias=bias,
            blocked=blocked,
            num_output=row_tensor(num_output, torch.int64),
            min_tokens=row_tensor([sp.min_tokens for sp in params], torch.int64),
            output_counts=_counts(outputs, vocab, device) if any_penalty else None,
            prompt_seen=(_counts([list(t[:n]) for t, n in zip(token_ids, num_prompt_tokens)], vocab, device) > 0
                         if any_repetition else None),
            presence=row_tensor([sp.presence_penalty for sp in params], torch.float32),
            frequency=row_tensor([sp.frequency_penalty for sp in params], torch.float32),
            repetition=row_tensor([sp.repetition_penalty for sp in params], torch.float32),
        )

    def apply(self, logits: torch.Tensor, draft_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Processed logits: [B, S, V] -> [B, S, V] float32 (a new tensor).

        draft_token_ids: [B, S-1] (-1 past a row's drafts), the tokens fed after slot 0;
        None or S = 1 for a plain decode or a prefill's first token.
        """
        b, s, vocab = logits.shape
        x = logits.float()
        if self.bias is not None:
            x = x + self.bias.unsqueeze(1)
        if self.blocked is not None:
            generated = self.num_output.unsqueeze(1) + torch.arange(s, device=x.device)  # [B, S]
            early = (generated < self.min_tokens.unsqueeze(1)).unsqueeze(-1)  # [B, S, 1]
            x = x.masked_fill(early & self.blocked.unsqueeze(1), float("-inf"))
        if self.output_counts is None:
            return x
        counts = self.output_counts.unsqueeze(1).expand(b, s, vocab)  # [B, S, V]
        if s > 1 and draft_token_ids is not None:
            d = draft_token_ids[:, : s - 1].long()  # [B, S-1]
            fed = torch.zeros(b, s, vocab, dtype=torch.float32, device=x.device)
            fed[:, 1:].scatter_(-1, d.clamp(min=0).unsqueeze(-1), (d >= 0).float().unsqueeze(-1))
            counts = counts + fed.cumsum(dim=1)  # slot i counts d_1..d_i
        if self.prompt_seen is not None:
            seen = self.prompt_seen.unsqueeze(1) | (counts > 0)  # [B, S, V]
            rep = torch.where(seen, self.repetition.view(b, 1, 1), 1.0)
            x = torch.where(x > 0, x / rep, x * rep)
        x = x - self.frequency.view(b, 1, 1) * counts
        return x - self.presence.view(b, 1, 1) * (counts > 0).float()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_top: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The model's log-softmax at each position: of the chosen token, and its top `num_top`.

    logits: [B, S, V] raw target logits (before temperature and every logit processor, as
    vLLM's default "raw_logprobs" reports them, so a token's logprob does not depend on
    how it was sampled); token_ids: [B, S] (-1 padding gives 0.0).
    Returns logprobs [B, S] float32, and top ids [B, S, num_top] int64 with their logprobs
    [B, S, num_top] float32 (None when num_top == 0).
    """
    lsm = torch.log_softmax(logits.float(), dim=-1)  # [B, S, V]
    chosen = lsm.gather(-1, token_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, S]
    chosen = torch.where(token_ids >= 0, chosen, 0.0)
    if num_top <= 0:
        return chosen, None, None
    top_lp, top_ids = torch.topk(lsm, min(num_top, lsm.shape[-1]), dim=-1)  # [B, S, N]
    return chosen, top_ids, top_lp
