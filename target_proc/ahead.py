"""Plain steps queued one step ahead: the overlap schedule (SchedulerConfig.overlap_schedule).

A plain step feeds each sequence its last token, so the plain step after it needs nothing
of its result but the sampled tokens, which are already on the device. The worker then
queues the next step's forward and sampling before it reads this step's tokens, and the
host's work between two steps (reading the tokens, stop rules, streaming, the draft's
outcomes, the round policy, the next batch's inputs) runs while the GPU computes, not
before it.

A sequence fed that way runs `ahead`: its host state lags one token behind the forward,
which starts at position num_tokens instead of num_tokens - 1, predicts position
num_tokens + 1, and needs one more KV row. A sequence the step under way ends by length
is left out of the next one; one it ends by a stop token or string computes one more
token, which is dropped (the K/V written at that position is the true one of the token
fed, so nothing stale is left in the cache).

Every upload of a queued step goes through pinned memory: a copy from pageable memory
waits for the GPU to finish the queued work first, which would serialize the steps again.
On a CPU the forward runs while it is queued, so there is nothing to overlap ("auto": on
CUDA only).

Only plain steps run ahead, and only when every running request allows it: a grammar
masks the next step's logits by this step's token, and penalties and min_tokens count it
on the host. Logprobs do not stop it: they are computed on the device at launch and
copied to the host with the tokens. With tensor parallelism (the other ranks take the
batch's token ids from the host) every step is synchronous.

A plain step queued ahead lands once the next step's plan is chosen. When that one is an
SSD or SD round, the landed step's outcomes go to the draft with its request
(`request_plan`): the draft answers it, and works ahead, while the GPU still runs the
step, so the first speculating step after plain ones verifies drafts (SD: a chain; SSD:
the plan's backup, as no tree stands behind the answer) and the next one looks up a tree.
Sent with the plain step's own flags instead, the first answered request would be the
speculating step's, one step later: that step would verify one token per sequence, and the
next the plan's backup.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_runtime.logits_process import needs_processing
from spec_runtime.sampling import to_device
from target_proc.round_policy import RoundPlan
from target_proc.sequence import Sequence


@dataclass
class Launched:
    """A step whose forward and sampling are queued: what its landing needs."""

    seqs: list[Sequence]  # in row order
    plan: RoundPlan
    specs: dict  # seq_id -> DraftTokens verified
    num_draft: list[int]
    out_tokens: torch.Tensor  # [B, k_max + 1] on the device
    host: tuple  # num_accepted [B], out_tokens and the logprobs tensors (or None), in host memory once `done`
    done: object  # a torch.cuda.Event recorded after their copy, or None (a CPU step)
    batch: int  # the running sequences when it was planned (a halves step runs fewer)
    t0: float  # the step began (perf_counter)
    t1: float  # its speculations were in
    row_of: dict[int, int]  # seq_id -> row, for the plain step queued after it
    lead: float = 0.0  # a synchronous step's host time between the landing before it and t0 (the worker's step)


def request_plan(landed: RoundPlan, upcoming: RoundPlan | None) -> RoundPlan:
    """The plan whose flags go with the outcomes of the step `landed` ran: `upcoming`, the
    next step's plan, when a plain step lands before an SSD or SD round (module doc), else
    the landed step's own. Halves steps answer one half per request: not led in."""
    if upcoming is not None and not landed.speculate and upcoming.kind in ("ssd", "sd"):
        return upcoming
    return landed


def to_host(*tensors):
    """(host copies, event): the copies (None stays None) are queued right behind the
    step's sampling, so the event completes with the step, not with the steps queued after
    it (a plain `.cpu()` at landing would wait for those too)."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in tensors)  # pinned
    done = torch.cuda.Event()
    done.record()
    return host, done


def allows_ahead(seqs: list[Sequence]) -> bool:
    """Whether a plain step over `seqs` may run ahead of the step before it lands (module doc)."""
    return all(s.grammar is None and not needs_processing(s.sampling) for s in seqs)


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Whether one more token ends `seq` by max_tokens or the context length."""
    return seq.will_finish(1) or seq.num_tokens + 1 >= max_model_len


def ahead_of(prev: Launched | None, seqs: list[Sequence]) -> list[int]:
    """Per sequence of the next step, its row in `prev` (the step still on the device), or -1."""
    if prev is None:
        return [-1] * len(seqs)
    row_of = prev.row_of
    return [row_of.get(s.seq_id, -1) for s in seqs]


def fill_tokens(prev: Launched, rows: list[int]):
    """The next step's input ids where rows[i] >= 0: prev's sampled token of row rows[i],
    copied on the device (a plain step feeds one token per sequence: item i is input row i).
    Returns the runner's `fill` callable, or None when no sequence runs ahead."""
    dst = [i for i, r in enumerate(rows) if r >= 0]
    if not dst:
        return None
    src = [rows[i] for i in dst]
    tokens = prev.out_tokens[:, 0]  # [B_prev]: a plain step's token is its first output
    if dst == src == list(range(len(dst))):  # the usual case: the same batch, in the same order
        n = len(dst)
        return lambda input_ids: input_ids[:n].copy_(tokens[:n])
    dst_t, src_t = (to_device(torch.tensor(x, dtype=torch.int64), tokens.device) for x in (dst, src))
    return lambda input_ids: input_ids.index_copy_(0, dst_t, tokens.index_select(0, src_t))
