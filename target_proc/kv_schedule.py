"""Which sequences hold the target's KV blocks: admission, growth and preemption.

Host bookkeeping over engine.kv_blocks.KVBlocks; the worker runs the forwards it asks for.

- Admission, oldest first: a waiting sequence gets the blocks its next forward needs,
  reusing its cached prefix; it waits while the pool cannot hold it with a block to
  spare per running sequence (so admitting one does not at once preempt another). The
  prefills of one step hold at most max_model_len tokens, the forward GPU memory was
  sized with.
- Growth: before each step every running sequence, oldest first, gets the rows of its
  next verify. When the pool runs out, the most recently admitted sequence is preempted:
  its blocks go back (its full ones stay in the prefix cache), and it waits at the head
  of the queue with its tokens so far. Admitted again, it recomputes its KV (often from
  the prefix cache) and decodes on; no token is sampled then, so its output is the one
  it would have had.
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


class KVScheduler:
    def __init__(self, kv: KVBlocks, k: int, max_model_len: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.k = k
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_preemptions = 0

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
        ones too: the worker drops those that finish on their first token)."""
        adm = Admission()
        resumed_items: list[ForwardItem] = []
        num_prefill = 0
        while waiting and len(running) < self.max_num_seqs:
            seq = waiting[0]
            num_kv = seq.num_tokens - 1 if seq.preempted else seq.num_tokens  # positions to hold K/V
            if num_prefill and num_prefill + num_kv > self.max_model_len:
                break
            # Prompt logprobs need every prompt position's logits: no cached prefix for them.
            num_cached = self.kv.admit(seq.seq_id, seq.token_ids, self.rows_needed(seq.num_tokens),
                                       0 if seq.preempted else seq.num_tokens, headroom=len(running),
                                       use_cache=seq.preempted or seq.sampling.prompt_logprobs is None)
            if num_cached is None:
                break  # blocks free up as running sequences finish
            waiting.popleft()
            running[seq.seq_id] = seq
            num_prefill += num_kv - num_cached
            rows = self.kv.rows(seq.seq_id, num_kv)
            if seq.preempted:
                seq.preempted = False
                adm.resumed.append(seq)
                if num_cached < num_kv:
                    resumed_items.append(ForwardItem(seq.token_ids[num_cached:num_kv], num_cached, rows, "none"))
                continue
            seq.stats.queue_s = time.monotonic() - seq.arrival_s
            seq.stats.num_cached_tokens = num_cached
            adm.new.append(seq)
            adm.items.append(ForwardItem(seq.token_ids[num_cached:], num_cached, rows,
                                         prefill_logits_mode(seq.sampling.prompt_logprobs)))
        adm.items += resumed_items
        return adm

    def reserve(self, running: dict[int, Sequence], waiting: deque[Sequence]) -> list[Sequence]:
        """Blocks for every running sequence's next forward, oldest first, preempting the
        newest while the pool is short. Returns the preempted sequences (now at the head
        of `waiting`)."""
        preempted: list[Sequence] = []
        for seq in list(running.values()):
            while seq.seq_id in running and not self.kv.grow(seq.seq_id, self.rows_needed(seq.num_tokens)):
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

    def commit(self, seq: Sequence) -> None:
        """seq's KV is final up to its last token (which is not fed yet)."""
        self.kv.commit(seq.seq_id, seq.token_ids, seq.num_tokens - 1)

    def release(self, seq: Sequence) -> None:
        """Give seq's blocks back; its full blocks stay findable in the prefix cache."""
        self.commit(seq)
        self.kv.free(seq.seq_id)
