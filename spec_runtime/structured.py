"""Structured outputs: grammars (llguidance), their token masks, and the grammar state of
each constrained sequence under speculation.

A request's `StructuredOutputs` (a JSON schema, any JSON object, a regex, a choice of
strings, or a Lark grammar) becomes an llguidance grammar; target_proc keeps one matcher
per constrained sequence and masks the target's logits with it in verification:

  - in a verify over [x_n, d_1..d_m], slot i is masked to the tokens the grammar allows
    after the committed output plus d_1..d_i. The matcher advances along the drafts to
    compute these masks (only along the valid prefix: past the first draft token the
    grammar refuses, no slot can be reached) and rolls back;
  - a draft token the grammar refuses has masked probability 0, so it is rejected (a
    greedy row never has it as argmax); the recovery or bonus token is sampled from the
    masked distribution, so it is allowed;
  - only the accepted drafts and the recovery/bonus token are committed to the matcher.
The sampler verifies against the masked target distribution, so the output follows
exactly the target's distribution restricted to the grammar, in every mode. The draft's
q stays a proposal (unmasked); a masked q would only raise acceptance.

Once the grammar is complete it allows only EOS; the sequence ends there (also with
ignore_eos). llguidance was chosen over xgrammar by measured mask time on CPU
(scripts/bench_grammar_mask.py; docs/structured_outputs.md).

The server side imports only `check_structured` and `BACKEND` (no torch).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from protocol.messages import StructuredOutputs

logger = logging.getLogger(__name__)

BACKEND = "llguidance"
# Compact JSON: no free whitespace between tokens, so a small model cannot pad its output
# with newlines until max_tokens (vLLM's default for its guidance backend too).
_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHE_SIZE = 64


def grammar_text(so: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint; ValueError where it cannot be built."""
    import llguidance

    m = llguidance.LLMatcher
    if so.kind == "json_schema":
        return m.grammar_from_json_schema(so.spec, defaults=_JSON_OPTIONS)
    if so.kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if so.kind == "regex":
        return m.grammar_from_regex(so.spec)
    if so.kind == "choice":
        choices = json.loads(so.spec)
        # Lark string literals take JSON's escapes.
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if so.kind == "grammar":
        return m.grammar_from_lark(so.spec)
    raise ValueError(f"unknown structured-output kind {so.kind!r}")


def check_structured(so: StructuredOutputs) -> str:
    """"" if the constraint compiles, else the reason it does not."""
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(so))
    except (ValueError, TypeError) as e:
        return str(e)
    return "; ".join(messages) if is_error else ""


class Grammars:
    """The grammars of one tokenizer: compiled once per distinct constraint (LRU), a
    fresh matcher per sequence, and the batched masks of a verify step.

    vocab_size: the model's (its logits' width); eos_token_ids: the ids that end a
    sequence, which the grammar allows once it is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._pristine: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _llg(self):
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            if self.hf_tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab,
                                                           eos_token=self.eos_token_ids or None)
            self._executor = llguidance.LLExecutor()
            self.num_words = n_vocab
            logger.info("structured outputs: llguidance tokenizer ready (%d tokens)", n_vocab)
        return self._tokenizer

    def start(self, so: StructuredOutputs):
        """A fresh matcher for one sequence; ValueError naming what does not compile."""
        import llguidance

        key = (so.kind, so.spec)
        pristine = self._pristine.get(key)
        if pristine is None:
            matcher = llguidance.LLMatcher(self._llg(), grammar_text(so), log_level=0)
            if matcher.is_error():
                raise ValueError(f"the {so.kind.replace('_', ' ')} does not compile: {matcher.get_error()}")
            self._pristine[key] = pristine = matcher
            if len(self._pristine) > _CACHE_SIZE:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(key)
        return pristine.deep_copy()

    def bitmask(self, matchers: Sequence, drafts: Sequence[Sequence[int]], num_slots: int) -> np.ndarray | None:
        """[B * num_slots, W] int32 bitmask (bit t of word t // 32: token t allowed) of
        each row's verify slots: slot i after the row's first i draft tokens. Rows
        without a matcher, and slots past a row's valid drafts, allow every token.
        None when no row has a matcher."""
        if not any(m is not None for m in matchers):
            return None
        import llguidance.numpy as llg_np

        self._llg()
        words = (self.num_words + 31) // 32
        out = np.full((len(matchers) * num_slots, words), -1, dtype=np.int32)
        plain, with_drafts = [], []
        for i, (m, d) in enumerate(zip(matchers, drafts)):
            if m is None:
                continue
            d = [int(t) for t in d[: num_slots - 1]]
            valid = m.validate_tokens(d) if d else 0
            if valid:
                with_drafts.append((m, i * num_slots, d[:valid]))
            else:
                plain.append((m, i * num_slots))
        if plain:
            llg_np.fill_next_token_bitmask_par(self._executor, plain, out)
        if with_drafts:
            llg_np.fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, out)
        return out

    def mask(self, matchers: Sequence, logits, drafts: Sequence[Sequence[int]] | None = None):
        """logits [B, S, V] with each constrained row's slots masked to what its grammar
        allows after the drafts fed before them (rows of None: unchanged)."""
        if not any(m is not None for m in matchers):
            return logits
        return apply_bitmask(logits, self.bitmask(matchers, drafts or [()] * len(matchers), logits.shape[1]))

    @staticmethod
    def commit(matcher, token_ids: Sequence[int]) -> bool:
        """Advance a sequence's matcher by its new tokens; False if the grammar refused one."""
        return matcher.consume_tokens([int(t) for t in token_ids])

    def advance(self, matcher, token_ids: Sequence[int], request_id: str = "") -> bool:
        """Commit a sequence's new tokens; True when its grammar is complete (the sequence
        ends there). A refused token (never sampled from a masked distribution) is logged."""
        if not self.commit(matcher, token_ids):
            logger.error("request %s: the grammar refused token(s) %s: %s", request_id, list(token_ids),
                         matcher.get_error())
        return self.complete(matcher)

    @staticmethod
    def complete(matcher) -> bool:
        """The grammar accepts nothing more (its output is whole)."""
        return matcher.is_stopped()


def apply_bitmask(logits, bitmask: np.ndarray):
    """logits [B, S, V] with the tokens the bitmask [B * S, W] refuses set to -inf (a new tensor)."""
    import torch

    b, s, vocab = logits.shape
    bits = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)  # [B * S, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(b, s, -1)[..., :vocab]  # [B, S, V]
    return logits.masked_fill(~allowed, float("-inf"))
