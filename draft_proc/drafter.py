"""Chain drafting with the draft model: K tokens per sequence, batched across sequences.

Step 0 feeds every token whose KV the slot lacks (the whole prompt for a new sequence;
x_n, or d_K and x_n after a full accept, otherwise) and samples d_1 from its last
logits. Steps 1..K-1 feed d_i and sample d_{i+1}. The KV of d_1..d_{K-1} stays in the
slot: if the target accepts them, the next round starts from there.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from draft_proc.speculator import Proposal, Speculator
from draft_proc.state import DraftSeq
from spec_runtime.model.forward_batch import ForwardItem
from spec_runtime.sampling import SamplingTensors, draft_sample, saguaro_rescale


class ModelDrafter(Speculator):
    def __init__(self, runner, spec_cfg, logits_transform=None):
        """logits_transform(logits [N, V], seqs, positions [N]) -> logits: the synthetic
        acceptance oracle in benchmarks; None otherwise."""
        self.runner = runner
        self.cfg = spec_cfg
        self.layout = runner.layout
        self.max_model_len = runner.layout.max_model_len
        self.logits_transform = logits_transform

    def sampling_tensors(self, seqs: list[DraftSeq]) -> SamplingTensors:
        t = self.cfg.draft_temperature
        return SamplingTensors.from_params(
            [(s.temperature if t is None else (t if s.temperature > 0 else 0.0), s.top_k, s.top_p, s.seed) for s in seqs],
            self.runner.device,
        )

    def sample(self, logits: torch.Tensor, seqs: list[DraftSeq], positions: np.ndarray, st: SamplingTensors,
               depth: int = 0):
        """Sample the draft token at `positions` (absolute) for each row; returns host arrays.

        depth: index of the token within its speculation (0..K-1). With Saguaro
        rescaling (SSD), q's top F_depth tokens, the ones the tree cache will fork at
        that depth, are scaled by the factor before sampling, and that rescaled q is
        what verification receives, so acceptance stays exact.
        """
        if self.logits_transform is not None:
            logits = self.logits_transform(logits, seqs, positions)
        if st.all_greedy:
            # No q is sent for greedy rows (it is one-hot on the token): argmax is all.
            return logits.argmax(dim=-1).cpu().numpy(), None, None  # sync: next step's input is built on the host
        pos = torch.from_numpy(positions).to(logits.device)
        rescale = None
        if self.cfg.mode == "ssd" and self.cfg.saguaro_rescale is not None:
            fan = self.cfg.fan_out_for(False)
            rescale = partial(saguaro_rescale, fan_out_f=fan[min(depth, len(fan) - 1)], factor=self.cfg.saguaro_rescale)
        tokens, q_ids, q_probs = draft_sample(logits, st, pos, self.cfg.draft_top_k, rescale=rescale)
        # sync: the next draft step's input tokens are built on the host.
        return tokens.cpu().numpy(), q_ids.cpu().numpy(), q_probs.cpu().numpy()

    def catch_up_items(self, seqs: list[DraftSeq]) -> list[ForwardItem]:
        """Feed every confirmed token the slot has no KV for; logits of the last one.

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
            items.append(ForwardItem(s.token_ids[start:], start, self.layout.slot_rows(s.slot, n), "last"))
        return items

    def propose(self, seqs: list[DraftSeq], k: int) -> Proposal:
        prop = Proposal.empty(len(seqs), k)
        if not seqs:
            return prop
        k_eff = np.array([max(0, min(k, self.max_model_len - s.num_tokens)) for s in seqs])
        sampled = any(s.temperature > 0 for s in seqs)
        top = self.cfg.draft_top_k
        if sampled:
            prop.q_token_ids = np.zeros((len(seqs), k, top), dtype=np.int64)
            prop.q_probs = np.zeros((len(seqs), k, top), dtype=np.float32)

        active = [b for b in range(len(seqs)) if k_eff[b] > 0]
        drafted: list[list[int]] = [[] for _ in seqs]
        for i in range(k):
            active = [b for b in active if k_eff[b] > i]
            if not active:
                break
            act_seqs = [seqs[b] for b in active]
            if i == 0:
                items = self.catch_up_items(act_seqs)
            else:
                items = [
                    ForwardItem([drafted[b][-1]], s.num_tokens + i - 1, self.layout.slot_rows(s.slot, s.num_tokens + i), "last")
                    for b, s in zip(active, act_seqs)
                ]
            logits = self.runner.run(items)  # [len(active), V]
            positions = np.array([s.num_tokens + i for s in act_seqs], dtype=np.int64)
            tokens, q_ids, q_probs = self.sample(logits, act_seqs, positions, self.sampling_tensors(act_seqs), depth=i)
            for r, b in enumerate(active):
                drafted[b].append(int(tokens[r]))
                if sampled:
                    w = q_ids.shape[-1]
                    prop.q_token_ids[b, i, :w] = q_ids[r]
                    prop.q_probs[b, i, :w] = q_probs[r]
        for b, s in enumerate(seqs):
            m = len(drafted[b])
            prop.draft_token_ids[b, :m] = drafted[b]
            prop.num_draft_tokens[b] = m
            # Fed: the confirmed tokens and d_1..d_{m-1}.
            s.set_speculation(drafted[b], num_cached=s.num_tokens + max(0, m - 1) if m else min(s.num_cached, s.num_tokens))
        return prop
