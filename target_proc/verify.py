"""The inputs of one verify step, prepared on the host and uploaded before the forward.

rejection_sample (spec_runtime.rejection) wants dense per-batch tensors: draft ids padded
to the longest speculation, the sparse q of each draft token, the sampling parameters
and the position of d_1. The forward's logits are flat and ragged (1 + m rows for a
sequence with m drafts; the runner drops the rows of its graph padding); `gather` picks
each sequence's verify rows out of them. Also the per-step helpers the worker shares
between its first-token and verify steps: sampling tensors, logit processors, and the
benchmark transform of the forward's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.sparse_q import NO_DRAFT, pack
from spec_runtime.logits_process import LogitsProcess, token_logprobs
from spec_runtime.sampling import SamplingTensors, to_device


@dataclass(frozen=True)
class VerifyInputs:
    """Device tensors of one verify step: rejection_sample's arguments, and `gather`."""

    gather: torch.Tensor  # [B, k_max + 1] row of the flat logits per (sequence, verify position)
    draft_token_ids: torch.Tensor  # [B, k_max] int64, PLACEHOLDER_TOKEN_ID past each row's drafts
    num_draft_tokens: torch.Tensor  # [B] int64
    q_token_ids: torch.Tensor | None  # [B, k_max, top_k_q] int64, None when every row is greedy
    q_probs: torch.Tensor | None  # [B, k_max, top_k_q] float32
    st: SamplingTensors
    positions: torch.Tensor  # [B] position of d_1


def verify_inputs(seqs, specs, num_draft, q_lens, k_max, st, device, bases=None) -> VerifyInputs:
    """Upload the inputs of rejection_sample, plus `gather`: for each (sequence, verify
    position) the row of the flat logits, clamped to the sequence's row m past its
    own drafts (those rows are masked by num_draft_tokens). bases: per sequence the
    position its first logits row predicts (default num_tokens; one more for a sequence
    that runs ahead, target_proc/ahead.py)."""
    m = np.asarray(num_draft, dtype=np.int64)
    gather = gather_rows(q_lens, m, k_max)
    # Each row verifies the first num_draft[i] drafts of its speculation.
    rows = [specs[s.seq_id].head(mi) if mi else NO_DRAFT for s, mi in zip(seqs, num_draft)]
    draft_ids, _, q_ids, q_probs = pack(rows, k_max)

    def dev(a):  # through pinned memory: a pageable copy would wait for the queued steps (target_proc/ahead.py)
        return None if a is None else to_device(torch.from_numpy(a), device)

    return VerifyInputs(
        gather=dev(gather),
        draft_token_ids=dev(draft_ids),
        num_draft_tokens=dev(m),
        q_token_ids=dev(q_ids),
        q_probs=dev(q_probs),
        st=st,
        positions=dev(np.array(bases if bases is not None else [s.num_tokens for s in seqs], dtype=np.int64)),
    )


def gather_rows(q_lens, num_draft: np.ndarray, k_max: int) -> np.ndarray:
    """[B, k_max + 1] int64: for each (sequence, verify position) its row of the flat logits
    (sequence i has q_lens[i] rows), clamped to its row num_draft[i]."""
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
    return starts[:, None] + np.minimum(np.arange(k_max + 1)[None, :], num_draft[:, None])


def device_logprobs(seqs, logits: torch.Tensor, out_tokens: torch.Tensor):
    """(logprobs [B, S], top ids [B, S, N] or None, top logprobs [B, S, N] or None) of the
    output tokens from the raw target logits [B, S, V], on their device; None when no row asks."""
    if not any(s.sampling.logprobs for s in seqs):
        return None
    return token_logprobs(logits, out_tokens, max(s.sampling.top_logprobs for s in seqs))


def logprobs_lists(logprobs):
    """`device_logprobs`' tensors (on the host, or copied there: a sync) as nested lists."""
    return None if logprobs is None else tuple(None if x is None else x.tolist() for x in logprobs)


def output_logprobs(seqs, logits: torch.Tensor, out_tokens: torch.Tensor):
    """Host lists of `device_logprobs` (a sync: the logprobs stream with their tokens)."""
    return logprobs_lists(device_logprobs(seqs, logits, out_tokens))


def logprobs_at(logprobs, i: int, t: int) -> tuple:
    """StopChecker.append's logprob arguments for row i, slot t of `output_logprobs`' result."""
    if logprobs is None:
        return (None, None, None)
    lp, top_ids, top_lp = logprobs
    return (lp[i][t], top_ids[i][t] if top_ids is not None else None, top_lp[i][t] if top_lp is not None else None)


def sampling_tensors(seqs, device) -> SamplingTensors:
    """The sequences' sampling parameters as device tensors (min_p only where one is set)."""
    return SamplingTensors.from_params(
        [(s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, s.seed) for s in seqs], device,
        min_p=[s.sampling.min_p for s in seqs] if any(s.sampling.min_p for s in seqs) else None,
    )


class SamplingCache:
    """The device sampling tensors of the last few batches, by their sequences' ids. A
    sequence's sampling parameters never change, so a batch that runs again (most steps)
    reuses its tensors: no per-row host loop and no upload."""

    def __init__(self, runner, size: int = 4):
        self.runner, self.size = runner, size  # the tensors go to runner.device
        self._by_batch: dict[tuple[int, ...], SamplingTensors] = {}

    def get(self, seqs) -> SamplingTensors:
        key = tuple(s.seq_id for s in seqs)
        st = self._by_batch.get(key)
        if st is None:
            if len(self._by_batch) >= self.size:  # the oldest batch goes
                del self._by_batch[next(iter(self._by_batch))]
            st = self._by_batch[key] = sampling_tensors(seqs, self.runner.device)
        return st


def logits_process(seqs, runner) -> LogitsProcess | None:
    """The sequences' logit processors (penalties, bias, banned tokens), None if none has any."""
    return LogitsProcess.build([s.sampling for s in seqs], [s.token_ids for s in seqs],
                               [s.num_prompt_tokens for s in seqs], runner.eos_token_ids, runner.vocab_size,
                               runner.device)


def transform_rows(transform, logits: torch.Tensor, seqs, q_lens: list[int], bases=None) -> torch.Tensor:
    """transform(logits, rows, positions) (the benchmark oracle), if set, over flat logits
    [sum(q_lens), V]: sequence s has q_lens rows, predicting positions b, b + 1, ... from
    its base b (bases, as in verify_inputs; default s.num_tokens)."""
    if transform is None:
        return logits
    rows = [s for s, q in zip(seqs, q_lens) for _ in range(q)]
    bases = bases if bases is not None else [s.num_tokens for s in seqs]
    pos = np.concatenate([np.arange(b, b + q, dtype=np.int64) for b, q in zip(bases, q_lens)])
    return transform(logits, rows, pos)
