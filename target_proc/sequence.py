"""Per-request state in target_proc, and the stop rules applied inside an accepted chunk.

Pure CPU bookkeeping: no torch, testable without a model.

A sequence's tokens are x_1..x_n (prompt, then generated). The target's KV cache holds
x_1..x_{n-1}: the last token x_n has been sampled but not yet fed, so the next forward
(decode, or verify of [x_n, d_1..d_K]) starts at position n - 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol.messages import PromptLogprobs, RequestStats, SamplingParams


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A fast tokenizer goes through `tokenizers`' DecodeStream, seeded with the prompt's last
    tokens so that tokens which only make sense with their left context (byte-level BPE,
    sentencepiece spaces) come out right, and which holds back an incomplete UTF-8 sequence
    until the token that completes it. A slow tokenizer, one whose decode cleans up spaces
    afterwards (which DecodeStream does not), or a prompt whose last tokens end inside a
    character, decodes a short window before the new tokens instead and holds back text
    that ends in "\\ufffd". Both give the same deltas; for text, they join to the text of
    decoding the generated tokens at once.
    """

    _CONTEXT = 6  # prompt tokens decoded before the first generated one

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        context = list(prompt_token_ids[-self._CONTEXT:])
        self._backend = _stream_backend(tokenizer)
        if self._backend is not None and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(
                "\ufffd"):
            # A context that ends inside a character (a token-id prompt): DecodeStream would put
            # the context's own text into the first delta; the window decoder does not.
            self._backend = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            return
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        if self._backend is not None:
            delta = self._stream.step(self._backend, token_id) or ""
        else:
            delta = self._add_window(token_id)
        self.text += delta
        return delta

    def _add_window(self, token_id: int) -> str:
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""


def _stream_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer whose decode adds nothing to
    the backend's own (no clean-up of spaces); None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import decoders
    except ImportError:
        return None
    return backend if hasattr(decoders, "DecodeStream") else None  # tokenizers >= 0.21


@dataclass
class Sequence:
    """One request as target_proc tracks it."""

    seq_id: int
    request_id: str
    client: bytes  # ROUTER identity of the client that sent it
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int
    # Preempted: its KV was freed; admission recomputes it (no new token is sampled then).
    preempted: bool = False
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_prompt_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    final_sent: bool = False
    stats: RequestStats = field(default_factory=RequestStats)
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float = 0.0
    detok: IncrementalDetokenizer | None = None
    # The grammar matcher of a structured-output request (spec_runtime.structured).
    grammar: object | None = None
    # Generated text so far, with any stop string cut off.
    text: str = ""
    # Characters of `text` already sent to the client.
    num_text_sent: int = 0
    # Unsent outputs of the current step.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top_ids: list[list[int]] = field(default_factory=list)
    pending_top_logprobs: list[list[float]] = field(default_factory=list)
    # The prompt's logprobs (SamplingParams.prompt_logprobs), until the first output takes them.
    prompt_logprobs: PromptLogprobs | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
            self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def will_finish(self, num_new: int) -> bool:
        """Whether num_new more tokens reach max_tokens (the draft need not follow it then)."""
        return self.num_generated + num_new >= self.sampling.max_tokens

    def take_text_delta(self) -> str:
        """Text not yet sent. While unfinished, hold back the last (longest stop - 1)
        characters: they might be the start of a stop string that the next token completes."""
        end = len(self.text)
        if not self.finished and self.sampling.stop:
            end -= max(len(s) for s in self.sampling.stop) - 1
        if end <= self.num_text_sent:
            return ""
        delta = self.text[self.num_text_sent : end]
        self.num_text_sent = end
        return delta


class StopChecker:
    """Applies EOS, stop token ids, stop strings and max_tokens one token at a time, so a
    stop that falls inside an accepted chunk cuts the chunk exactly there."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token_id: int, logprob: float | None = None,
               top_ids: list[int] | None = None, top_logprobs: list[float] | None = None) -> bool:
        """Append one accepted token to seq; return True when seq is now finished.

        Token ids after a stop are never appended. EOS and stop token ids are kept in
        token_ids but contribute no text; a stop string is cut from the text (OpenAI
        semantics; include_stop_str_in_output keeps it) and the token that completed it
        ends the output. Before min_tokens tokens, stop strings do not stop (EOS and stop
        token ids cannot occur: the sampler masks them).
        """
        sp = seq.sampling
        seq.token_ids.append(token_id)
        seq.pending_token_ids.append(token_id)
        if logprob is not None and sp.logprobs:
            seq.pending_logprobs.append(logprob)
            if sp.top_logprobs:
                seq.pending_top_ids.append(list(top_ids[: sp.top_logprobs]))
                seq.pending_top_logprobs.append(list(top_logprobs[: sp.top_logprobs]))
        if not seq.first_token_s:
            seq.first_token_s = time.monotonic()

        if token_id in sp.stop_token_ids:
            seq.stop_reason = token_id
            return self._finish(seq, "stop")
        if token_id in self.eos_token_ids and not sp.ignore_eos:
            return self._finish(seq, "stop")

        if seq.detok is not None:
            delta = seq.detok.add(token_id)
            if delta:
                seq.text += delta
                if sp.stop and seq.num_generated > sp.min_tokens and self._cut_stop_string(seq, len(delta)):
                    return self._finish(seq, "stop")

        if seq.num_generated >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length")
        return False

    @staticmethod
    def _cut_stop_string(seq: Sequence, delta_len: int) -> bool:
        # Only a stop string that ends inside the new delta can be new.
        longest = max(len(s) for s in seq.sampling.stop)
        window_start = max(0, len(seq.text) - delta_len - longest + 1)
        window = seq.text[window_start:]
        best, found = -1, ""
        for s in seq.sampling.stop:
            i = window.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, found = i, s
        if best < 0:
            return False
        end = window_start + best + (len(found) if seq.sampling.include_stop_str_in_output else 0)
        seq.text = seq.text[:end]
        seq.stop_reason = found
        return True

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> bool:
        seq.finished = True
        seq.finish_reason = reason
        return True
