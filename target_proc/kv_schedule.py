"""Which sequences hold the target's KV blocks: admission, growth and preemption.

Host bookkeeping over engine.kv_blocks.KVBlocks; the worker runs the forwards it asks for.

- Admission, oldest first: a waiting sequence gets the blocks its next forward needs,
  reusing its cached prefix; it waits while the pool cannot hold it with a block to
  spare per running sequence (so admitting one does not at once preempt another).
  Without a step budget the prefills of one step hold at most max_model_len tokens, the
  forward GPU memory was sized with.
- Growth: before each step every running sequence, oldest first, gets the rows of its
  next verify. When the pool runs out, the most recently admitted sequence is preempted:
  its blocks go back (its full ones stay in the prefix cache), and it waits at the head
  of the queue with its tokens so far. Admitted again, it recomputes its KV (often from
  the prefix cache) and decodes on; no token is sampled then, so its output is the one
  it would have had.
- Chunked prefill (a step budget, --max-num-batched-tokens): a step computes at most
  `budget` tokens, the verify of every running sequence (K + 1 each, counted first) and
  prefill pieces together. The head of the queue that does not fit whole gets a piece of
  what is left and stays at the head, holding its blocks, until its last piece; only
  then does it join the running sequences (the worker samples its first token and tells
  the draft). When the pool runs short, that prefill gives its blocks back before any
  running sequence is preempted. A prompt-logprobs request's pieces return every
  position's logits; its logprobs are gathered piece by piece.
- Shared prompts (n > 1 sends n requests with one prompt; clients often send one system
  prompt at once): a waiting sequence whose full prompt blocks are among those a
  prefill of this step computes waits one step and then finds them in the prefix cache,
  so the shared part is prefilled once.
- Up front: a request that could not run even alone in the pool is refused.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from spec_runtime.engine.forward_batch import ForwardItem
from spec_runtime.engine.kv_blocks import KVBlocks
from target_proc.prompt_logprobs import prefill_logits_mode
from target_proc.sequence import Sequence
from spec_runtime.validate import RequestError

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    """One step's admissions: new sequences (prefill, then sample their first token) and
    preempted ones back in (recompute only). `items` holds the new ones' forwards first
    (logits "last", or "all" for prompt logprobs), then the preempted ones' ("none")."""

    new: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    items: list[ForwardItem] = field(default_factory=list)
    # A piece of a chunked prefill and its forward (the last of `items`): logits "all" for
    # a prompt-logprobs request, else "none".
    piece: tuple[Sequence, ForwardItem] | None = None


class KVScheduler:
    def __init__(self, kv: KVBlocks, k: int, max_model_len: int, max_num_seqs: int,
                 budget: int | None = None) -> None:
        """budget: tokens one step may compute (chunked prefill), None for whole prompts."""
        self.kv = kv
        self.k = k
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_preemptions = 0
        self.budget = budget
        if budget is not None and budget < max_num_seqs * (k + 1):
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs x (K + 1) = "
                             f"{max_num_seqs * (k + 1)}: every running sequence's verify must fit in one step")
        # seq_id -> positions whose K/V is computed, for the sequence at the head of the
        # waiting queue while it holds blocks (its prefill in chunks).
        self.prefilled: dict[int, int] = {}
        self.num_prefill_chunks = 0
        # Tokens of the step under way (its prefills, then its verify) and the most any took.
        self.step_tokens = self.max_step_tokens = 0

    def rows_needed(self, num_tokens: int) -> int:
        """KV rows a sequence of num_tokens tokens needs for its next forward: a verify
        writes [x_n, d_1..d_K] at positions n - 1 .. n - 1 + K (padded to K + 1 tokens)."""
        return min(num_tokens + self.k, self.max_model_len)

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Refuse a request that could not run even alone in the KV pool."""
        need = self.rows_needed(num_prompt + max_tokens - 1)
        kv = self.kv
        if kv.blocks_for(need) > kv.num_blocks:
            raise RequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV cache rows, more than the "
                f"KV cache holds ({kv.num_blocks} blocks of {kv.block_size} = {kv.num_rows} rows); send a shorter "
                "prompt or fewer max_tokens")

    def admit(self, waiting: deque[Sequence], running: dict[int, Sequence]) -> Admission:
        """Move the sequences that fit from the head of `waiting` into `running` (new
        ones too: the worker drops those that finish on their first token). With chunked
        prefill the head may instead get a piece of its prefill and stay at the head."""
        adm = Admission()
        resumed_items: list[ForwardItem] = []
        num_prefill = 0
        computing: set[bytes] = set()  # names of the full blocks this step's prefills compute
        while waiting and len(running) < self.max_num_seqs:
            seq = waiting[0]
            num_kv = seq.num_tokens - 1 if seq.preempted else seq.num_tokens  # positions to hold K/V
            hashes = self._lookup_hashes(seq)
            if computing.intersection(hashes):
                break  # it shares blocks this step computes: next step it finds them cached
            chunked = self.budget is not None
            if chunked:
                room = self.budget - (len(running) + 1) * (self.k + 1) - num_prefill  # if it joins the verify
                if room + self.k + 1 <= 0:
                    break
            elif num_prefill and num_prefill + num_kv > self.max_model_len:
                break
            start = self._take_blocks(seq, num_kv, len(running))
            if start is None:
                break  # blocks free up as running sequences finish
            if chunked and num_kv - start > room:
                # A piece now, the rest in later steps; it does not join the verify.
                end = start + min(num_kv - start - 1, room + self.k + 1)
                if end > start:
                    self.prefilled[seq.seq_id] = end
                    self.num_prefill_chunks += 1
                    want_all = not seq.preempted and seq.sampling.prompt_logprobs is not None
                    adm.piece = (seq, ForwardItem(seq.token_ids[start:end], start, self.kv.rows(seq.seq_id, end),
                                                  "all" if want_all else "none"))
                    resumed_items.append(adm.piece[1])
                    # Its forward runs before any other admission looks the cache up.
                    self.kv.commit(seq.seq_id, seq.token_ids, end)
                break
            waiting.popleft()
            self.prefilled.pop(seq.seq_id, None)
            computing.update(hashes[start // self.kv.block_size:])
            running[seq.seq_id] = seq
            num_prefill += num_kv - start
            rows = self.kv.rows(seq.seq_id, num_kv)
            if seq.preempted:
                seq.preempted = False
                adm.resumed.append(seq)
                if start < num_kv:
                    resumed_items.append(ForwardItem(seq.token_ids[start:num_kv], start, rows, "none"))
                continue
            adm.new.append(seq)
            adm.items.append(ForwardItem(seq.token_ids[start:], start, rows,
                                         prefill_logits_mode(seq.sampling.prompt_logprobs)))
        adm.items += resumed_items
        self.step_tokens = 0
        self.count_step_tokens(sum(len(it.token_ids) for it in adm.items))
        return adm

    def _lookup_hashes(self, seq: Sequence) -> list[bytes]:
        """The prefix-cache names of seq's full blocks, for the ones that look it up."""
        if seq.seq_id in self.prefilled or not (seq.preempted or seq.sampling.prompt_logprobs is None):
            return []
        return self.kv.lookup_hashes(seq.seq_id, seq.token_ids)

    def count_step_tokens(self, num_tokens: int) -> None:
        """Add a forward's tokens to the step under way (admit starts each step)."""
        self.step_tokens += num_tokens
        self.max_step_tokens = max(self.max_step_tokens, self.step_tokens)

    def _take_blocks(self, seq: Sequence, num_kv: int, num_running: int) -> int | None:
        """The position seq's next prefill piece starts at: its progress when it already
        holds blocks (a chunked prefill under way), else the cached prefix of the blocks
        it takes now; None when the pool cannot take it yet."""
        if seq.seq_id in self.prefilled:
            return self.prefilled[seq.seq_id]
        # Prompt logprobs need every prompt position's logits: no cached prefix for them.
        num_cached = self.kv.admit(seq.seq_id, seq.token_ids, self.rows_needed(seq.num_tokens),
                                   0 if seq.preempted else seq.num_tokens, headroom=num_running,
                                   use_cache=seq.preempted or seq.sampling.prompt_logprobs is None)
        if num_cached is not None and not seq.preempted:
            seq.stats.queue_s = time.monotonic() - seq.arrival_s
            seq.stats.num_cached_tokens = num_cached
        if num_cached is not None:
            self.prefilled[seq.seq_id] = num_cached
        return num_cached

    def reserve(self, running: dict[int, Sequence], waiting: deque[Sequence], ahead=()) -> list[Sequence]:
        """Blocks for every running sequence's next forward, oldest first, preempting the
        newest while the pool is short. Returns the preempted sequences (now at the head
        of `waiting`). ahead: ids of sequences whose last token is still on the device
        (target_proc/ahead.py): their next forward starts one position later."""
        preempted: list[Sequence] = []
        for seq in list(running.values()):
            need = self.rows_needed(seq.num_tokens + (seq.seq_id in ahead))
            while seq.seq_id in running and not self.kv.grow(seq.seq_id, need):
                if self.prefilled:  # the newest holder: a prefill in chunks, not yet running
                    self._drop_prefill(next(s for s in waiting if s.seq_id in self.prefilled))
                    continue
                victim = next(reversed(running.values()))
                logger.info("preempting request %s (%d tokens): the KV cache is full",
                            victim.request_id, victim.num_tokens)
                del running[victim.seq_id]
                self.release(victim)
                victim.preempted = True
                victim.stats.num_preemptions += 1
                self.num_preemptions += 1
                waiting.appendleft(victim)
                preempted.append(victim)
        return preempted

    def _drop_prefill(self, seq: Sequence) -> None:
        """Take the blocks of the chunked prefill at the head of `waiting`; its computed
        full blocks stay in the prefix cache and it starts over when blocks free up. The
        draft does not know it yet, so there is nothing to re-sync."""
        logger.info("preempting request %s while it prefills (%d of %d tokens): the KV cache is full",
                    seq.request_id, self.prefilled[seq.seq_id], seq.num_tokens)
        self.release(seq)
        seq.stats.num_preemptions += 1
        self.num_preemptions += 1

    def commit(self, seq: Sequence) -> None:
        """seq's KV is final up to its last token (which is not fed yet)."""
        self.kv.commit(seq.seq_id, seq.token_ids, seq.num_tokens - 1)

    def release(self, seq: Sequence) -> None:
        """Give seq's blocks back; its full blocks of final K/V stay findable in the prefix
        cache (those of a chunked prefill: only the pieces computed)."""
        num_prefilled = self.prefilled.pop(seq.seq_id, None)
        if num_prefilled is None:
            self.commit(seq)
        else:
            self.kv.commit(seq.seq_id, seq.token_ids, num_prefilled)
            if not seq.preempted:
                seq.prompt_logprobs = None  # of the pieces computed: it starts over, or ends
        self.kv.free(seq.seq_id)
