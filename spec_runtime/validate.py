"""Checks on a request's sampling parameters and prompt.

The front end (Client, HTTP server, CLI) runs `validate_sampling` before a request is
sent, so a bad value fails in the caller's thread. target_proc runs `validate_request`
on every GenerateRequest before it reaches the scheduler: a request that fails gets an
ErrorReply(code="bad_request") naming the problem, nothing about it is scheduled, and
every other request is unaffected.
"""

from __future__ import annotations

import math

import numpy as np

from protocol.messages import STRUCTURED_KINDS, GenerateRequest, SamplingParams


MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_GRAMMAR_CHARS = 1 << 20


class RequestError(ValueError):
    pass


def validate_sampling(sp: SamplingParams) -> None:
    if sp.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {sp.max_tokens}")
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {sp.temperature}")
    # The upper bound keeps top_k representable as int64 on the device; any value above
    # the vocabulary size already means "off".
    if not 0 <= sp.top_k < 2**31:
        raise RequestError(f"top_k must be in [0, 2**31) (0 disables it), got {sp.top_k}")
    if not (0.0 < sp.top_p <= 1.0):
        raise RequestError(f"top_p must be in (0, 1], got {sp.top_p}")
    if sp.seed is not None and not (0 <= sp.seed < 2**63):
        raise RequestError(f"seed must be in [0, 2**63), got {sp.seed}")
    if any(not s for s in sp.stop):
        raise RequestError("stop strings must be non-empty")
    if len(sp.stop) > 16 or any(len(s) > 256 for s in sp.stop):
        raise RequestError("at most 16 stop strings of at most 256 characters")
    if not 0 <= sp.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {sp.top_logprobs}")
    if sp.top_logprobs and not sp.logprobs:
        raise RequestError("top_logprobs needs logprobs=True")
    if sp.prompt_logprobs is not None and not 0 <= sp.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {sp.prompt_logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sp, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise RequestError(f"{name} must be in [-2, 2], got {value}")
    if not (math.isfinite(sp.repetition_penalty) and 0.0 < sp.repetition_penalty <= 100.0):
        raise RequestError(f"repetition_penalty must be in (0, 100] (1 disables it), got {sp.repetition_penalty}")
    if not (math.isfinite(sp.min_p) and 0.0 <= sp.min_p <= 1.0):
        raise RequestError(f"min_p must be in [0, 1], got {sp.min_p}")
    if not 0 <= sp.min_tokens <= sp.max_tokens:
        raise RequestError(f"min_tokens must be in [0, max_tokens={sp.max_tokens}], got {sp.min_tokens}")
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(sp.logit_bias)}")
    for t, b in sp.logit_bias.items():
        if not (math.isfinite(b) and -100.0 <= b <= 100.0):
            raise RequestError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
    if sp.structured is not None:
        if sp.structured.kind not in STRUCTURED_KINDS:
            raise RequestError(f"structured.kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                               f"got {sp.structured.kind!r}")
        if len(sp.structured.spec) > MAX_GRAMMAR_CHARS:
            raise RequestError(f"structured.spec is over {MAX_GRAMMAR_CHARS} characters")
        if sp.min_tokens:
            # The grammar decides where the output ends; min_tokens would mask the end it allows.
            raise RequestError("min_tokens cannot be combined with structured outputs")


def validate_request(req: GenerateRequest, vocab_size: int, max_model_len: int) -> list[int]:
    """Return the prompt as a list of ints, or raise RequestError."""
    validate_sampling(req.sampling)
    if not req.request_id:
        raise RequestError("request_id must be non-empty")
    ids = np.asarray(req.prompt_token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise RequestError("prompt_token_ids must be a non-empty 1-D array")
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"prompt_token_ids must be integers, got {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got range [{ids.min()}, {ids.max()}]")
    for t in req.sampling.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"stop token id {t} is outside [0, {vocab_size})")
    for t in req.sampling.logit_bias:
        if not 0 <= t < vocab_size:
            raise RequestError(f"logit_bias token id {t} is outside [0, {vocab_size})")
    if ids.size + req.sampling.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({ids.size} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the context "
            f"length {max_model_len}"
        )
    return ids.astype(np.int64).tolist()
