"""Prompt logprobs from the target's prefill.

A request with SamplingParams.prompt_logprobs set is prefilled with logits for every
prompt row ("all") instead of the last one only. Row i of those logits is the target's
distribution of prompt token i + 1, so the n - 1 rows before the last give the prompt's
logprobs (the first token has none, as in vLLM and OpenAI's echo), and the last row is
the one every request samples its first token from. Generation does not change: the
sampler sees the same last row whichever mode was asked.

The logprobs are the raw log-softmax (before temperature and every logit processor), as
the logprobs of generated tokens are (spec_runtime.logits_process.token_logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.messages import PromptLogprobs

# Rows per log-softmax: bounds the float32 copies of [rows, vocabulary] it makes.
_CHUNK_ROWS = 512


def prefill_logits_mode(prompt_logprobs: int | None) -> str:
    """The ForwardItem logits mode of a prefill."""
    return "last" if prompt_logprobs is None else "all"


def split_prefill_logits(logits: torch.Tensor, num_rows: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Split a prefill's flat logits [sum(num_rows), V] (request r has num_rows[r] rows:
    1 for "last", its prompt length for "all"; rows after them are left out) into each request's last row [R, V] and
    its rows before the last (empty for "last")."""
    logits = logits[:sum(num_rows)]  # rows of later items (a chunked prefill's piece) follow
    if all(n == 1 for n in num_rows):
        return logits, [logits[:0]] * len(num_rows)
    ends = torch.tensor(num_rows, device=logits.device).cumsum(0)
    last = logits[ends - 1]  # [R, V]
    starts = [0] + ends[:-1].tolist()
    return last, [logits[s: s + n - 1] for s, n in zip(starts, num_rows)]


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], num_top: int) -> PromptLogprobs:
    """PromptLogprobs of a prompt from its prefill rows before the last, logits [n - 1, V]
    (row i predicts prompt_token_ids[i + 1]), with num_top alternatives per token."""
    n = len(prompt_token_ids)
    if logits.shape[0] != n - 1:
        raise ValueError(f"{logits.shape[0]} logits rows for a prompt of {n} tokens (want {n - 1})")
    targets = torch.as_tensor(list(prompt_token_ids[1:]), dtype=torch.int64, device=logits.device)  # [n - 1]
    lps, ranks, top_ids, top_lps = [], [], [], []
    for lo in range(0, n - 1, _CHUNK_ROWS):
        lsm = torch.log_softmax(logits[lo: lo + _CHUNK_ROWS].float(), dim=-1)  # [c, V]
        chosen = lsm.gather(1, targets[lo: lo + _CHUNK_ROWS, None])  # [c, 1]
        lps.append(chosen[:, 0])
        ranks.append((lsm > chosen).sum(dim=1) + 1)  # ties share the better rank
        if num_top:
            t_lp, t_ids = torch.topk(lsm, min(num_top, lsm.shape[-1]), dim=-1)  # [c, num_top]
            top_ids.append(t_ids)
            top_lps.append(t_lp)
    if n == 1:
        return PromptLogprobs()
    # sync: the logprobs travel to the client with the first token
    return PromptLogprobs(
        logprobs=torch.cat(lps).cpu().tolist(), ranks=torch.cat(ranks).cpu().tolist(),
        top_token_ids=torch.cat(top_ids).cpu().tolist() if num_top else [],
        top_logprobs=torch.cat(top_lps).cpu().tolist() if num_top else [],
    )


def merge_prompt_logprobs(head: PromptLogprobs | None, tail: PromptLogprobs) -> PromptLogprobs:
    """The prompt logprobs of two consecutive prefill pieces (chunked prefill) as one."""
    if head is None:
        return tail
    return PromptLogprobs(logprobs=head.logprobs + tail.logprobs, ranks=head.ranks + tail.ranks,
                          top_token_ids=head.top_token_ids + tail.top_token_ids,
                          top_logprobs=head.top_logprobs + tail.top_logprobs)


def add_prompt_logprobs(seq, start: int, rows: torch.Tensor, last: bool) -> None:
    """Add a prefill piece's prompt logprobs to seq's: the piece fed prompt tokens from
    `start` on and gave logits `rows` (one per token, or for the last piece the ones
    before its last, which predicts the first generated token)."""
    ids = seq.prompt_token_ids[start:] if last else seq.prompt_token_ids[start:start + rows.shape[0] + 1]
    seq.prompt_logprobs = merge_prompt_logprobs(seq.prompt_logprobs,
                                                prompt_logprobs(rows, ids, seq.sampling.prompt_logprobs))
