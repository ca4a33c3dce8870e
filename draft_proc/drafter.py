"""Chain drafting with the draft model: K tokens per sequence, batched across sequences.

Step 0 feeds every token whose KV the sequence lacks (the prompt past its cached prefix
for a new sequence; x_n, or d_K and x_n after a full accept, otherwise) and samples d_1
from its last logits. Steps 1..K-1 feed d_i and sample d_{i+1}. The KV of d_1..d_{K-1}
stays in the sequence's rows (draft_proc/kv.py): if the target accepts them, the next
round starts from there.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from draft_proc.kv import SlotRows
from draft_proc.speculator import Speculator
from draft_proc.state import DraftSeq
from protocol.sparse_q import NO_DRAFT, DraftTokens
from spec_runtime.engine.forward_batch import ForwardItem, build_forward_batch
from spec_runtime.sampling import SamplingTensors, draft_sample, saguaro_rescale, to_device


class ModelDrafter(Speculator):
    def __init__(self, runner, spec_cfg, logits_transform=None, kv=None):
        """logits_transform(logits [N, V], seqs, positions [N]) -> logits: the synthetic
        acceptance oracle in benchmarks; None otherwise. kv: the sequences' rows
        (draft_proc.kv.DraftKV over a paged runner; default: by slot, SlotRows)."""
        self.runner = runner
        self.cfg = spec_cfg
        self.layout = runner.layout
        self.kv = kv if kv is not None else SlotRows(runner.layout)
        self.max_model_len = runner.layout.max_model_len
        self.logits_transform = logits_transform

    def sampling_tensors(self, seqs: list[DraftSeq]) -> SamplingTensors:
        t = self.cfg.draft_temperature
        return SamplingTensors.from_params(
            [(s.temperature if t is None else (t if s.temperature > 0 else 0.0), s.top_k, s.top_p, s.seed) for s in seqs],
            self.runner.device,
        )

    def sample(self, logits: torch.Tensor, seqs: list[DraftSeq], positions: np.ndarray, st: SamplingTensors,
               depth: int = 0, transform=None):
        """Sample the draft token at `positions` (absolute) for each row; returns device
        tensors (token_ids [R], q_token_ids [R, top] | None, q_probs [R, top] | None).

        transform: this step's transform of a chain (logits_transform.chain), if any.
        positions: [R] host values or a device tensor. depth: index of the token within
        its speculation (0..K-1). With Saguaro
        rescaling (SSD), q's top F_depth tokens, the ones the tree cache will fork at
        that depth, are scaled by the factor before sampling, and that rescaled q is
        what verification receives, so acceptance stays exact.
        """
        if transform is not None:
            logits = transform(logits)  # this step of a chain's precomputed oracle
        elif self.logits_transform is not None:
            logits = self.logits_transform(logits, seqs, positions)
        if st.all_greedy:
            # No q is sent for greedy rows (it is one-hot on the token): argmax is all.
            return logits.argmax(dim=-1), None, None
        pos = positions if isinstance(positions, torch.Tensor) else to_device(torch.from_numpy(positions), logits.device)
        rescale = None
        if self.cfg.mode == "ssd" and self.cfg.saguaro_rescale is not None:
            fan = self.cfg.fan_out_for(False)
            rescale = partial(saguaro_rescale, fan_out_f=fan[min(depth, len(fan) - 1)], factor=self.cfg.saguaro_rescale)
        return draft_sample(logits, st, pos, self.cfg.draft_top_k, rescale=rescale)

    def decode_chain(self, first: list[ForwardItem], later, rows: list[DraftSeq], positions: np.ndarray,
                     num_steps: int):
        """num_steps draft steps over a fixed set of rows; returns host arrays
        tokens [R, S], q_token_ids [R, S, top] | None, q_probs [R, S, top] | None.

        Step 0 feeds `first`; step i >= 1 feeds later(i) (host metadata: positions and KV
        rows do not depend on the sampled tokens) with each row's token from step i - 1
        copied in on the device. positions: [R] absolute position of the token sampled
        at step 0.
        """
        device = self.runner.device

        def make_batch(i, prev):
            batch = build_forward_batch(first if i == 0 else later(i), device)
            if prev is not None:
                batch.input_ids.copy_(prev)  # [R]
            return batch

        return self.run_chain(make_batch, rows, positions, num_steps)

    def run_chain(self, make_batch, rows: list[DraftSeq], positions: np.ndarray, num_steps: int,
                  select: torch.Tensor | None = None, offsets: tuple[torch.Tensor, int] | None = None):
        """The loop under decode_chain and the SSD tree decode. make_batch(i, prev) is
        step i's ForwardBatch, prev the [T] device tokens of step i - 1 (None at step 0).
        select: [R] device indices of the logits rows that belong to `rows` (a tree step
        carries padding tokens); None: every row. offsets: ([R] device values in [0, most],
        most): each row's positions lie that much past `positions` (the depths of forks
        chosen on the device). Returns what decode_chain returns.

        The host builds step i + 1 while the GPU runs step i and syncs once per
        speculation instead of once per token (with flashinfer graphs, the backend's plan
        waits for the previous plan's copy: attention/cuda.py).
        """
        device = self.runner.device
        tokens, q_ids, q_probs = [], [], []
        chain = getattr(self.logits_transform, "chain", None)
        steps_tf = [None] * num_steps
        prev = st = pos = None
        for i in range(num_steps):
            batch = make_batch(i, prev)
            logits = self.runner.forward(batch, rows=select)  # [R, V]: `rows`' logits (every row without select)
            if i == 0:
                # What sampling reads, built while step 0 runs on the GPU: its launch waits for none of it.
                st = self.sampling_tensors(rows)
                # A greedy chain samples by argmax: only a sampled one reads the positions (the oracle has its own).
                moved = offsets is not None and not st.all_greedy
                pos = to_device(torch.from_numpy(positions), device) + offsets[0] if moved else positions
                if chain is not None:  # the benchmark oracle of every step at once
                    steps_tf = chain(rows, positions, num_steps, self.runner.vocab_size, device, offsets=offsets)
            tok, qi, qp = self.sample(logits, rows, pos + i, st, depth=i, transform=steps_tf[i])
            if select is None:
                prev = tok
            else:  # padding tokens feed 0
                prev = torch.zeros(batch.input_ids.shape[0], dtype=torch.int64, device=device)
                prev.index_copy_(0, select, tok)
            tokens.append(tok)
            q_ids.append(qi)
            q_probs.append(qp)
        # sync: the speculation goes to the target from the host.
        out_tokens = torch.stack(tokens, dim=1).cpu().numpy()
        if q_ids[0] is None:
            return out_tokens, None, None
        return out_tokens, torch.stack(q_ids, 1).cpu().numpy(), torch.stack(q_probs, 1).cpu().numpy()

    def catch_up_items(self, seqs: list[DraftSeq]) -> list[ForwardItem]:
        """Feed every confirmed token the sequence has no KV for; logits of the last one.

        That is one token (t) or two (d_K and t after a full accept); always feeding two
        (re-feeding x_{n-1} when only t is new) gives every sequence the same shape, so
        the step replays one CUDA graph instead of running eagerly.
        """
        items = []
        for s in seqs:
            n = s.num_tokens
            start = min(s.num_cached, n - 1)
            if start == n - 1 and n >= 2:
                start = n - 2
            items.append(ForwardItem(s.token_ids[start:], start, self.kv.rows(s, n), "last"))
        return items

    def keep_up(self, seqs: list[DraftSeq]) -> None:
        """Feed every confirmed token but the last that a sequence has no KV for.

        After a run of plain steps each sequence would otherwise carry one uncached token
        per step into its next chain, whose first step then runs eagerly over all of them
        (a ragged shape no graph holds) while the target waits. Fed as they arrive (one
        request holds up to K plain steps: target_proc.draft_link), they take one forward
        of at most K + 1 tokens per sequence while the target verifies, padded to a graph's
        shape (every row's logits are asked for only because the runner pads nothing else:
        cuda_graphs.pad_to_graph), and the next chain starts with its two-token catch-up."""
        items, fed = [], []
        for s in seqs:
            n = s.num_tokens
            if s.num_cached < n - 1:
                items.append(ForwardItem(s.token_ids[s.num_cached:n - 1], s.num_cached, self.kv.rows(s, n - 1), "all"))
                fed.append(s)
        if items:
            self.runner.run(items)
            for s in fed:
                s.num_cached = s.num_tokens - 1

    def propose(self, seqs: list[DraftSeq], k: int) -> list[DraftTokens]:
        out = [NO_DRAFT] * len(seqs)
        if not seqs:
            return out
        k_eff = np.array([max(0, min(k, self.max_model_len - s.num_tokens)) for s in seqs])
        # Sequences near the context limit draft fewer tokens: one chain per length.
        for steps in sorted(set(k_eff.tolist()) - {0}):
            idx = np.flatnonzero(k_eff == steps)
            rows = [seqs[b] for b in idx]
            kv = self.kv

            def later(i, rows=rows):
                return [ForwardItem([0], s.num_tokens + i - 1, kv.rows(s, s.num_tokens + i), "last") for s in rows]

            positions = np.array([s.num_tokens for s in rows], dtype=np.int64)
            tokens, q_ids, q_probs = self.decode_chain(self.catch_up_items(rows), later, rows, positions, steps)
            for r, b in enumerate(idx):
                out[b] = DraftTokens(tokens[r], None if q_ids is None else q_ids[r],
                                     None if q_ids is None else q_probs[r])
        for b, s in enumerate(seqs):
            m = out[b].num_draft_tokens
            # Fed: the confirmed tokens and d_1..d_{m-1}.
            s.set_speculation(out[b].draft_token_ids.tolist(),
                              num_cached=s.num_tokens + max(0, m - 1) if m else min(s.num_cached, s.num_tokens))
        return out
