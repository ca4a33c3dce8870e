"""The inputs of one verify step, prepared on the host and uploaded before the forward.

rejection_sample (spec_runtime.sampling) wants dense per-batch tensors: draft ids padded
to the longest speculation, the sparse q of each draft token, the sampling parameters
and the position of d_1. The forward's logits are flat (ragged, or padded to K+1 per
sequence for CUDA graphs); `gather` picks each sequence's K+1 verify rows out of them.
"""

from __future__ import annotations

import numpy as np
import torch


def verify_inputs(seqs, specs, num_draft, q_lens, k_max, st, device) -> dict:
    """Device tensors for rejection_sample, plus `gather`: for each (sequence, verify
    position) the row of the flat logits, clamped to the sequence's row m past its
    own drafts (those rows are masked by num_draft_tokens)."""
    b = len(seqs)
    m = np.asarray(num_draft, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    gather = starts[:, None] + np.minimum(np.arange(k_max + 1)[None, :], m[:, None])  # [B, k_max + 1]
    draft_ids = np.full((b, k_max), -1, dtype=np.int64)
    with_q = [specs[s.seq_id].q_token_ids for i, s in enumerate(seqs)
              if num_draft[i] > 0 and specs[s.seq_id].q_token_ids is not None]
    q_ids = q_probs = None
    if with_q:
        top = max(q.shape[-1] for q in with_q)
        q_ids = np.zeros((b, k_max, top), dtype=np.int64)
        q_probs = np.zeros((b, k_max, top), dtype=np.float32)
    for i, seq in enumerate(seqs):
        mi = num_draft[i]
        if mi == 0:
            continue
        spec = specs[seq.seq_id]
        draft_ids[i, :mi] = spec.draft_token_ids[:mi]
        if q_ids is not None:
            if spec.q_token_ids is None:  # greedy draft in a sampled batch: q is one-hot
                q_ids[i, :mi, 0] = spec.draft_token_ids[:mi]
                q_probs[i, :mi, 0] = 1.0
            else:
                w = spec.q_token_ids.shape[-1]
                q_ids[i, :mi, :w] = spec.q_token_ids[:mi]
                q_probs[i, :mi, :w] = spec.q_probs[:mi]

    def dev(a):
        return None if a is None else torch.from_numpy(a).to(device, non_blocking=True)

    return {
        "gather": dev(gather),
        "draft_token_ids": dev(draft_ids),
        "num_draft_tokens": dev(m),
        "q_token_ids": dev(q_ids),
        "q_probs": dev(q_probs),
        "st": st,
        "positions": dev(np.array([s.num_tokens for s in seqs], dtype=np.int64)),
    }
