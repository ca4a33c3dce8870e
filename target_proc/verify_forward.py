"""The verify forward of a speculating step, laid out while the draft answers.

A speculating step waits for the draft's answer before its forward can run, yet most of
the forward's inputs do not depend on the answer: each sequence's positions and KV rows,
the page table, the CUDA graph's static inputs and attention plan, the sampling tensors
and where each sequence's rows sit in the logits. So the worker lays the forward out
(`lay_out`) for as many drafts per sequence as it may verify (`draft_limit`), before it
waits; once the answer is in, `forward_laid_out` writes the draft ids into the laid-out
token ids, uploads the rest of rejection sampling's inputs in one copy, and replays. The
host's work between the answer and the GPU's start shrinks to those few operations (at
batch 1 on one H200 the GPU sat idle 0.8 ms before each verify's graph, for the 8B and the
32B target alike: docs/benchmarks.md).

A sequence answered with fewer drafts than laid out verifies the ones it has: the rows
past them are computed and never read (`gather` stops at its last draft and
num_draft_tokens masks the rest), and their K/V lands in rows the sequence reserved past
its accepted tokens, where a rejected draft's K/V lands too. An answer the layout does
not fit (its longest speculation shorter than the layout's, which a smaller graph would
run) is built once it is in (`forward_after_answer`), as is every forward no CUDA graph
would replay (the CPU, tensor parallelism, a batch past the largest graph: `lay_out`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.sparse_q import NO_DRAFT, pack
from spec_runtime.engine.forward_batch import ForwardItem, upload_int64
from spec_runtime.sampling import to_device
from target_proc.verify import VerifyInputs, gather_rows, transform_rows, verify_inputs


@dataclass
class VerifyForward:
    """A verify forward queued on the device: its logits and what rejection sampling takes."""

    flat_logits: torch.Tensor  # [sum(q_lens), V]
    inputs: VerifyInputs
    num_draft: list[int]  # drafts verified per sequence
    q_lens: list[int]  # logits rows per sequence


@dataclass
class LaidOut:
    """A verify forward laid out for `limits` drafts per sequence (lay_out)."""

    seqs: list
    limits: list[int]
    prep: object  # ModelRunner.Prepared
    draft_index: torch.Tensor  # flat indices in prep.input_ids of each sequence's draft slots, row-major
    st: object  # SamplingTensors
    positions: torch.Tensor  # [B] position of d_1


def draft_limit(seq, n: int, k: int, max_model_len: int) -> int:
    """The most drafts a step may verify for `seq` fed from position n - 1: never more than K
    (the KV rows reserved), past the context or past max_tokens (the last token is free)."""
    return max(0, min(k, max_model_len - n, seq.sampling.max_tokens - seq.num_generated - 1))


def forward_after_answer(worker, seqs, specs, rows, fill) -> VerifyForward:
    """The verify forward of `specs` built and queued at once. rows: per sequence its row in the
    step still on the device (target_proc/ahead.py), or -1; fill: the runner's fill for those."""
    items, num_draft, q_lens, bases = [], [], [], []
    for seq, r in zip(seqs, rows):
        spec = specs.get(seq.seq_id)
        n = seq.num_tokens + (r >= 0)  # ahead: its last token is prev's, on the device
        m = 0 if spec is None else min(len(spec.draft_token_ids), draft_limit(seq, n, worker.k, worker.max_model_len))
        fed = [seq.last_token_id] + (spec.draft_token_ids[:m].tolist() if m else [])
        items.append(ForwardItem(fed, n - 1, worker.kv.rows(seq.seq_id, n - 1 + len(fed)), "all"))
        num_draft.append(m)
        q_lens.append(len(fed))
        bases.append(n)
    # Upload the verify inputs before the forward is queued: then nothing between the
    # forward and the acceptance kernels waits on the GPU.
    inputs = verify_inputs(seqs, specs, num_draft, q_lens, max(num_draft, default=0),
                           worker.sampling_cache.get(seqs), worker.runner.device, bases)
    flat = transform_rows(worker.logits_transform, worker.runner.run(items, fill), seqs, q_lens, bases)
    return VerifyForward(flat, inputs, num_draft, q_lens)


def lay_out(worker, seqs, eager: bool = False) -> LaidOut | None:
    """The verify forward of `seqs`, each with as many drafts as it may verify (the drafts'
    slots hold its last token until the answer comes), laid out in the runner; None where the
    runner cannot (ModelRunner.prepare) and, unless `eager`, where no CUDA graph would run it:
    an eager forward gains little from it, and one of more tokens than the answer's rounds
    differently on a CPU (a graph runs the padded shape either way)."""
    k, runner = worker.k, worker.runner
    if not runner.can_prepare(eager):  # nothing built per step where nothing would be laid out
        return None
    limits = [draft_limit(s, s.num_tokens, k, worker.max_model_len) for s in seqs]
    items = [ForwardItem([s.last_token_id] * (1 + m), s.num_tokens - 1, worker.kv.rows(s.seq_id, s.num_tokens + m),
                         "all") for s, m in zip(seqs, limits)]
    prep = runner.prepare(items, eager)
    if prep is None:
        return None
    # Draft j of sequence i (j below its limit) is token 1 + j of item i.
    index = [prep.token_index(i, 1 + j) for i, m in enumerate(limits) for j in range(m)]
    draft_index, positions = upload_int64([np.asarray(index, dtype=np.int64),
                                           np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))],
                                          runner.device)
    return LaidOut(seqs, limits, prep, draft_index, worker.sampling_cache.get(seqs), positions)


def forward_laid_out(worker, lo: LaidOut, specs) -> VerifyForward | None:
    """The laid-out forward of lo.seqs with the drafts of `specs`, queued; None where the answer
    does not fit it (the module doc): forward_after_answer runs it then."""
    seqs, limits = lo.seqs, lo.limits
    num_draft = [min(len((specs.get(s.seq_id) or NO_DRAFT).draft_token_ids), m) for s, m in zip(seqs, limits)]
    k_max = max(limits, default=0)
    if max(num_draft, default=0) != k_max:
        return None
    dense = [specs[s.seq_id].head(m) if m else NO_DRAFT for s, m in zip(seqs, num_draft)]
    draft_ids, _, q_ids, q_probs = pack(dense, k_max)
    # Each sequence's draft slots up to its limit, row-major as lay_out's index; a slot past its
    # drafts keeps the sequence's last token.
    last = np.array([s.last_token_id for s in seqs], dtype=np.int64)[:, None]
    fed = np.where(draft_ids >= 0, draft_ids, last)[np.arange(k_max)[None, :] < np.asarray(limits)[:, None]]
    q_lens = [1 + m for m in limits]
    m = np.asarray(num_draft, dtype=np.int64)
    gather = gather_rows(q_lens, m, k_max)  # [B, k_max + 1], over the layout's rows
    parts = [fed, gather.reshape(-1), draft_ids.reshape(-1), m]
    if q_ids is not None:  # some sequence samples: its q's token ids in the same copy
        parts.append(q_ids.reshape(-1))
    device = worker.runner.device
    fed_d, gather_d, ids_d, m_d, *q_d = upload_int64(parts, device)
    b = len(seqs)
    if len(fed):
        lo.prep.input_ids.index_copy_(0, lo.draft_index, fed_d)
    inputs = VerifyInputs(gather=gather_d.view(b, k_max + 1), draft_token_ids=ids_d.view(b, k_max),
                          num_draft_tokens=m_d, q_token_ids=q_d[0].view(q_ids.shape) if q_d else None,
                          q_probs=None if q_probs is None else to_device(torch.from_numpy(q_probs), device),
                          st=lo.st, positions=lo.positions)
    bases = [s.num_tokens for s in seqs]
    flat = transform_rows(worker.logits_transform, worker.runner.run_prepared(lo.prep), seqs, q_lens, bases)
    return VerifyForward(flat, inputs, num_draft, q_lens)
