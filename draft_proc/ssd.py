"""SSD (Speculative Speculative Decoding, arXiv 2603.03251): the draft works ahead.

On a SpecRequest the draft looks each outcome (j, t) up in its tree cache; a hit is
answered with the cached speculation at once, a miss by the backup speculator (jit:
draft K tokens now; ngram; none: no drafts, the target verifies only its own token).
Then, while the target verifies what it was just sent, the draft works ahead:

  glue:        one forward over [x_n, d_1..d_m] per sequence: writes their KV to the
               sequence's rows and yields the draft's distribution at every depth 0..m;
  fork:        the top-F_j tokens at depth j (excluding d_{j+1}), see tree_cache.py;
               on a GPU chosen on the device (fork_device.py), so nothing waits for
               the glue's ranking to reach the host;
  tree decode: K steps over all branches of all sequences in one batch; a branch
               attends to its sequence's rows [0, n + j) and its own scratch rows. The
               branches of a sequence are the tokens of one request under a
               shared-prefix mask (forward_batch.TreeMask): the prefix [0, n) is read
               once per sequence per step, and a step's metadata is built once per
               work-ahead and moved on by device adds, so neither the GPU's nor the
               host's work per branch grows with the context. The first step is laid
               out while the glue's forward runs (tree_layout.py);
  store:       the branches replace the sequence's cache entries.

A sequence just added (AddSequence) has no speculation yet; its first outcome is
(0, t), t the target's first sampled token. `prefetch` works ahead for such sequences
while the target prefills, so that first look-up can hit too. With no speculation
(m = 0) depth 0 is the only outcome depth, so it gets the sequence's whole branch budget.

Sampling stays exact at any temperature: a branch's tokens are sampled with the same
counter-based randomness (request seed, position) the chain drafter uses, and the q
stored with them is exactly the distribution each was sampled from.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from draft_proc.fork_device import DeviceForks, choose_on_device, rank
from draft_proc.speculator import Speculator
from draft_proc.state import DraftSeq
from draft_proc.tree_budget import TreeBudget
from draft_proc.tree_cache import BranchTable, Forks, TreeCache, select_forks_groups
from draft_proc.tree_layout import TreeLayout, fork_counts
from protocol.sparse_q import NO_DRAFT, put_q
from spec_runtime.config import pow2_at_least
from spec_runtime.engine.forward_batch import ForwardItem, tree_step_batch
from spec_runtime.sampling import to_device

logger = logging.getLogger(__name__)


class SSDEngine:
    def __init__(self, drafter, backup: Speculator | None, spec_cfg):
        self.drafter = drafter
        self.runner = drafter.runner
        self.layout = drafter.layout
        self.kv = drafter.kv
        self.backup = backup
        self.cfg = spec_cfg
        self.k = spec_cfg.k
        self.cache = TreeCache(spec_cfg.max_branches(), spec_cfg.k, self.layout.scratch_base)
        self.budget = TreeBudget(spec_cfg.branches_per_seq, "fixed" if spec_cfg.tree_pinned else "auto")
        self._requested_branches = 0  # this work-ahead's branches per sequence, as the request named (0: none)
        self._pending: dict[int, DraftTokens | None] = {}
        self._pending_depth: dict[int, int] = {}
        self.num_hits = 0
        self.num_misses = 0
        self.last_work_s = 0.0
        # Forks chosen where the glue ranks them (fork_device.py): on a GPU (a benchmark oracle
        # then lays its steps out there too: DraftOracle.chain), or where a test asks.
        oracle = drafter.logits_transform
        self.forks_on_device = self.runner.device.type == "cuda" and (oracle is None or hasattr(oracle, "chain"))
        # Running per-token acceptance rate (accepted / attempted draft positions), which
        # weighs the outcome depths when forks compete for the budget.
        self._accepted = 7.0
        self._attempted = 10.0

    # ---------------------------------------------------------------- answer

    def note_outcome(self, seq: DraftSeq, num_accepted: int, token_id: int) -> None:
        """Look the outcome up before the sequence's state moves past it."""
        self._pending[seq.seq_id] = self.cache.lookup(seq.seq_id, num_accepted, token_id)
        self._pending_depth[seq.seq_id] = num_accepted
        m = len(seq.draft_token_ids) if seq.awaiting_outcome else 0
        if m:
            decay = 0.98  # forget slowly: acceptance drifts with the text
            self._accepted = decay * self._accepted + num_accepted
            self._attempted = decay * self._attempted + min(num_accepted + 1, m)

    @property
    def accept_rate(self) -> float:
        return self._accepted / self._attempted

    def propose(self, seqs: list[DraftSeq], k: int, count_misses: bool = True,
                backup_k: int | None = None) -> tuple[list[DraftTokens], list[int]]:
        """Answer each sequence from the tree cache (cache_hit), misses from the backup;
        and the hits per outcome depth. count_misses: False after a round without
        work-ahead (a synchronous SD round, not a miss). backup_k: tokens the backup
        drafts for a miss this round (default k; 0 answers misses with no drafts)."""
        backup_k = k if backup_k is None else backup_k
        out = [NO_DRAFT] * len(seqs)
        hits_by_depth = [0] * (self.k + 1)
        misses: list[int] = []
        for b, seq in enumerate(seqs):
            entry = self._pending.pop(seq.seq_id, None)
            depth = self._pending_depth.pop(seq.seq_id, 0)
            if entry is None:
                misses.append(b)
                continue
            m = min(entry.num_draft_tokens, k)
            hits_by_depth[depth] += 1
            out[b] = dataclasses.replace(entry.head(m), cache_hit=True)
            # The branch's KV is in scratch; the slot is valid up to the token before t.
            seq.set_speculation(entry.draft_token_ids[:m].tolist(), num_cached=min(seq.num_cached, seq.num_tokens - 1))
            seq.last_missed = False
        self.num_hits += len(seqs) - len(misses)
        if count_misses:
            self.num_misses += len(misses)
        if misses:
            miss_seqs = [seqs[b] for b in misses]
            for s in miss_seqs:
                s.last_missed = True
            if self.backup is None or not backup_k:
                for s in miss_seqs:
                    s.set_no_speculation()
            else:
                for b, spec in zip(misses, self.backup.propose(miss_seqs, backup_k)):
                    out[b] = spec
        return out, hits_by_depth

    # ---------------------------------------------------------------- work ahead

    def work_ahead(self, seqs: list[DraftSeq], k: int, branches: int = 0) -> None:
        """branches: per sequence, as the request named it (a level of the tree ladder;
        0: TreeBudget's own choice)."""
        t0 = time.perf_counter()
        seqs = [s for s in seqs if s.num_tokens < self.layout.max_model_len]
        self._requested_branches = self.budget.follow(len(seqs), branches) if seqs and branches > 0 else 0
        if seqs:
            ranked = self._glue(seqs)
            groups = self._fork_groups(seqs)
            # The first tree step is laid out while the glue's forward runs, before the forks.
            layout = self._layout(seqs, fork_counts(groups, len(seqs), self._branches_per_seq(len(seqs))), k)
            forks = self._fork(seqs, ranked, groups, layout, k)
            if len(forks):
                self._tree_decode(seqs, forks, k, layout)
            else:
                for s in seqs:
                    self.cache.replace(s.seq_id, {})
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # sync: measure the work, not its launch
        self.last_work_s = time.perf_counter() - t0

    def take_in(self, seqs: list[DraftSeq]) -> None:
        """A plain step's outcomes, which nobody waits an answer for: their look-ups
        answer nothing, and no work-ahead follows."""
        for s in seqs:
            self._pending.pop(s.seq_id, None)
            self._pending_depth.pop(s.seq_id, None)
        self.skip_work_ahead(seqs)

    def skip_work_ahead(self, seqs: list[DraftSeq]) -> None:
        """No work-ahead this round: drop the entries that answered it, and give each
        sequence answered from the tree its speculation's KV. A hit's tokens have KV
        only in the branch's scratch rows; fed into the sequence's own rows now, while
        the target verifies, the chain the next request asks for takes in just the
        outcome (one or two tokens, a graph's shape) instead of the whole branch in an
        eager forward first."""
        for s in seqs:
            self.cache.clear(s.seq_id)
        self.last_work_s = 0.0
        hits = [s for s in seqs if s.draft_token_ids and s.num_cached < s.num_tokens]
        if not hits:
            return
        # num_cached < num_tokens: the tokens from there on, then the whole speculation.
        self.runner.run([ForwardItem(s.token_ids[s.num_cached:] + s.draft_token_ids, s.num_cached,
                                     self.kv.rows(s, s.num_tokens + len(s.draft_token_ids)), "none") for s in hits])
        for s in hits:
            s.num_cached = s.num_tokens + len(s.draft_token_ids)

    def prefetch(self, seqs: list[DraftSeq]) -> None:
        """Work ahead for fresh sequences (added, no outcome yet) at the configured K, so
        their first outcome (0, t) can hit.

        Their state is (prompt, no speculation, not awaiting an outcome), which work_ahead
        treats like any round with m = 0: glue prefills the prompt and ranks depth 0, the
        forks are the likeliest first tokens, and each branch holds K tokens (a later
        SpecRequest with a smaller k gets a prefix). `last_work_s` keeps describing the
        last round's work, not the prefetch.
        """
        for s in seqs:
            if s.awaiting_outcome or s.draft_token_ids:
                raise ValueError(f"sequence {s.seq_id} already has a speculation; only fresh sequences are prefetched")
        if not seqs:
            return
        round_work_s = self.last_work_s
        try:
            self.work_ahead(seqs, self.k)
        except Exception:
            # Leave nothing half done: the first outcome misses and the backup starts over.
            for s in seqs:
                self.cache.clear(s.seq_id)
                s.num_cached = 0
            raise
        finally:
            self.last_work_s = round_work_s

    def _branches_per_seq(self, batch: int) -> int:
        # The total budget bounds the tree-decode batch whatever the batch size; within
        # it, the request's choice or TreeBudget's keeps the work-ahead inside the target's verify.
        return self._requested_branches or self.budget.branches(batch)

    def _glue(self, seqs: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Forward [x_n, d_1..d_m]; the ranked candidates and their draft probabilities
        [sum(m + 1), R] on the device, sequence by sequence, and each sequence's first row [B]."""
        lagging = [s for s in seqs if s.num_cached < s.num_tokens - 1]
        if lagging:
            # The backup drafted nothing, so the prompt was never prefilled: do it now.
            self.runner.run([
                ForwardItem(s.token_ids[s.num_cached : s.num_tokens - 1], s.num_cached,
                            self.kv.rows(s, s.num_tokens - 1), "none")
                for s in lagging
            ])
        # Each sequence feeds its real length; the runner pads to its graph's shape.
        items = []
        for s in seqs:
            n, fed = s.num_tokens, [s.token_ids[-1]] + list(s.draft_token_ids)
            items.append(ForwardItem(fed, n - 1, self.kv.rows(s, n - 1 + len(fed)), "all"))
        logits = self.runner.run(items)  # [sum(m + 1), V]
        positions = np.concatenate([np.arange(s.num_tokens, s.num_tokens + len(s.draft_token_ids) + 1) for s in seqs])
        row_seqs = [s for s in seqs for _ in range(len(s.draft_token_ids) + 1)]
        if self.drafter.logits_transform is not None:
            logits = self.drafter.logits_transform(logits, row_seqs, positions)
        # Rank by logits: temperature keeps the order, and top-k/top-p only cut the tail
        # (for greedy rows the sampling distribution is one-hot and would rank nothing).
        width = max(max(self.cfg.fan_out_for(True)), max(self.cfg.fan_out_for(False))) + 1
        if any(not s.draft_token_ids for s in seqs):
            width = max(width, self._branches_per_seq(len(seqs)))  # m = 0 forks its whole budget at depth 0
        ids, probs = rank(logits, min(width, logits.shape[-1]))
        starts = np.zeros(len(seqs), dtype=np.int64)  # each sequence's first row of the ranking
        start = 0
        for i, s in enumerate(seqs):
            starts[i] = start
            start += len(s.draft_token_ids) + 1
            s.num_cached = s.num_tokens + len(s.draft_token_ids)
        return ids, probs, starts

    def _fork_groups(self, seqs: list[DraftSeq]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
        """(drafts count m, fan-out) -> the indices of the sequences that fork with them."""
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(seqs):
            # No speculation (a fresh sequence, or a backup that drafted nothing): every
            # outcome is at depth 0, so the whole budget goes there.
            fan = self.cfg.fan_out_for(s.last_missed) if s.draft_token_ids else (self._branches_per_seq(len(seqs)),)
            groups.setdefault((len(s.draft_token_ids), fan), []).append(i)
        return groups

    def _fork(self, seqs: list[DraftSeq], ranked: tuple[torch.Tensor, torch.Tensor, np.ndarray], groups,
              layout: TreeLayout | None = None, k: int = 0) -> Forks | DeviceForks:
        """On the device where the layout fixes the forks' shape and every branch runs k steps
        (forks_on_device); on the host otherwise."""
        per_seq = self._branches_per_seq(len(seqs))
        end = max(s.num_tokens + len(s.draft_token_ids) for s in seqs) + 1 + k  # past the deepest branch
        if self.forks_on_device and layout is not None and end <= self.layout.max_model_len:
            forks = choose_on_device(ranked, groups, [s.draft_token_ids for s in seqs], per_seq, self.accept_rate,
                                     layout)
            if forks is not None:
                return forks
        host = (ranked[0].cpu().numpy(), ranked[1].cpu().numpy(), ranked[2])  # sync: forks chosen on the host
        return select_forks_groups(groups, seqs, host, per_seq, self.accept_rate)

    def _tree_decode(self, seqs: list[DraftSeq], forks: Forks | DeviceForks, k: int,
                     layout: TreeLayout | None = None) -> None:
        """layout: the first step laid out for the forks expected (_layout); the shared-prefix
        step uses it if the forks match it, a layout of their own if not (forks chosen on the
        device are the layout's, and every branch of theirs runs k steps: _fork)."""
        on_device = isinstance(forks, DeviceForks)
        n = layout.n if on_device else np.array([s.num_tokens for s in seqs], dtype=np.int64)[forks.seq]
        # Outcome (j, t) leaves the sequence with n + j + 1 tokens; its speculation is
        # capped like the chain drafter's, at max_model_len - (n + j + 1).
        lens = (np.full(len(forks), k) if on_device
                else np.clip(np.minimum(k, self.layout.max_model_len - (n + forks.depth + 1)), 0, None))
        sampled = any(s.temperature > 0 for s in seqs)
        top = self.cfg.draft_top_k
        tokens = np.full((len(forks), k), -1, dtype=np.int64)
        q_ids = np.zeros((len(forks), k, top), dtype=np.int64) if sampled else None
        q_probs = np.zeros((len(forks), k, top), dtype=np.float32) if sampled else None
        if k > 0 and (lens == k).all():
            if not on_device and (layout is None or not layout.matches(forks)):
                layout = self._layout(seqs, np.bincount(forks.seq, minlength=len(seqs)), k)
            if layout is not None:
                forks, valid = self._tree_decode_shared(seqs, forks, layout, n, k, tokens, q_ids, q_probs, sampled)
                self._store(seqs, forks, lens, tokens, q_ids, q_probs, sampled, valid)
                return
        # All branches of all sequences step together (one batch per step); branches near
        # the context limit are shorter, so there is one pipelined chain per length.
        for steps in sorted(set(lens.tolist()) - {0}):
            idx = np.flatnonzero(lens == steps)
            rows = [seqs[i] for i in forks.seq[idx]]
            prefix = (n + forks.depth)[idx].tolist()  # the sequence's rows [0, n + j)
            prefix_rows = [self.kv.rows(s, p) for s, p in zip(rows, prefix)]
            branch, first_tok = forks.branch[idx].tolist(), forks.token_id[idx].tolist()

            def items(i, tok=None, rows=rows, prefix=prefix, prefix_rows=prefix_rows, branch=branch, first=first_tok):
                return [
                    ForwardItem([t if tok is None else 0], p + i,
                                np.concatenate([pr, self.cache.scratch_rows(s.slot, b, i + 1)]), "last")
                    for s, p, pr, b, t in zip(rows, prefix, prefix_rows, branch, first)
                ]

            toks, qi, qp = self.drafter.decode_chain(items(0), lambda i: items(i, tok=0), rows,
                                                     np.array(prefix, dtype=np.int64) + 1, steps)
            tokens[idx, :steps] = toks
            if sampled:  # greedy branches in a sampled batch get a one-hot q
                put_q(q_ids, q_probs, (idx, slice(0, steps)), toks, qi, qp)
        self._store(seqs, forks, lens, tokens, q_ids, q_probs, sampled)

    def tree_q_len(self, num_seqs: int, most: int) -> int | None:
        """Branches per request of the shared-prefix tree step when one sequence has at most
        `most` branches, or None where the backend cannot run one (the per-branch layout
        is used then)."""
        q_len = most
        if self.runner.graphs is not None:
            q_len = max(q_len, pow2_at_least(self._branches_per_seq(num_seqs)))  # the graph's shape
        return q_len if self.runner.backend.supports_tree(q_len) else None

    def _layout(self, seqs: list[DraftSeq], counts: np.ndarray, k: int) -> TreeLayout | None:
        """The shared-prefix tree step for counts [B] forks per sequence, laid out before
        they are chosen (tree_layout.py); None where it cannot run (the per-branch layout
        is used then): a tree the attention cannot run, or outside the scratch rows."""
        most = int(counts.max(initial=0))
        q_len = self.tree_q_len(len(seqs), most) if most else None
        if q_len is None or not 0 < k <= self.cache.k or most > self.cache.max_branches:
            return None
        present = np.flatnonzero(counts)
        n = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        m = np.array([len(s.draft_token_ids) for s in seqs], dtype=np.int64)
        prefixes, accepted = [], np.full((len(present), int(m[present].max())), self.runner.dummy_row, dtype=np.int64)
        for r, i in enumerate(present.tolist()):
            rows = self.kv.rows(seqs[i], int(n[i] + m[i]))  # the glue wrote d_1..d_m's rows
            prefixes.append(rows[: n[i]])
            accepted[r, : m[i]] = rows[n[i]:]
        slot = np.array([s.slot for s in seqs], dtype=np.int64)
        scratch = self.cache.scratch_base + slot * self.cache.max_branches * self.cache.k  # branch 0's rows
        return TreeLayout(prefixes, counts, n, accepted, scratch, self.cache.k, k, q_len, self.runner.dummy_row)

    def _tree_decode_shared(self, seqs, forks: Forks | DeviceForks, layout: TreeLayout, n, k, tokens, q_ids,
                            q_probs, sampled) -> tuple[Forks, np.ndarray | None]:
        """K tree steps with one request per sequence and its branches as the request's
        tokens; the prefix [0, n) is shared (n [F]: each fork's sequence length), each
        branch sees its accepted drafts [n, n + j) and its scratch rows. Returns the forks
        on the host and, for forks the device chose (read back with the tokens), which of
        them are valid (None: every fork)."""
        device = self.runner.device
        if isinstance(forks, DeviceForks):  # written with the forks; positions move on by their depths there
            first, select_d = forks.first, forks.token_index
            positions, offsets = n + 1, (forks.depth, max(len(s.draft_token_ids) for s in seqs))
        else:
            first = layout.batch(forks, device)
            select_d = to_device(torch.from_numpy(layout.arrays.token), device)
            positions, offsets = n + forks.depth + 1, None

        def make_batch(i, prev):
            return first if i == 0 else tree_step_batch(first, i, prev)

        rows = [seqs[i] for i in forks.seq.tolist()]
        toks, qi, qp = self.drafter.run_chain(make_batch, rows, positions, k, select=select_d, offsets=offsets)
        tokens[:] = toks
        if sampled:  # greedy branches in a sampled batch get a one-hot q
            put_q(q_ids, q_probs, (slice(None), slice(None)), toks, qi, qp)
        return forks.to_host() if isinstance(forks, DeviceForks) else (forks, None)

    def _store(self, seqs, forks: Forks, lens, tokens, q_ids, q_probs, sampled, valid=None) -> None:
        """Each branch's row of this work-ahead's arrays under its outcome (valid [F]: only
        where True; None: every branch)."""
        table = BranchTable(tokens, q_ids if sampled else None, q_probs if sampled else None, lens, forks.rank)
        keys: list[dict[tuple[int, int], int]] = [{} for _ in seqs]
        for b, (i, j, t) in enumerate(zip(forks.seq.tolist(), forks.depth.tolist(), forks.token_id.tolist())):
            if valid is None or valid[b]:
                keys[i][(j, t)] = b
        for s, k in zip(seqs, keys):
            self.cache.replace_rows(s.seq_id, k, table)

    # ---------------------------------------------------------------- bookkeeping

    def release(self, seq: DraftSeq) -> None:
        self.cache.clear(seq.seq_id)
        self._pending.pop(seq.seq_id, None)
        self._pending_depth.pop(seq.seq_id, None)

    def num_entries(self) -> int:
        return self.cache.num_entries()
