"""OpenAI request models, their validation into SamplingParams, and response bodies.

Everything here runs before a request reaches the engine: a request that fails gets
HTTP 400 with OpenAI's error body and is never submitted. Unknown fields are ignored
(as OpenAI-compatible servers do, so newer SDKs keep working); known options this
runtime does not implement (n > 1, best_of, logit_bias, penalties, logprobs, echo,
suffix, tools) are rejected by name instead of being silently dropped.

spec-runtime extensions, accepted in the body (the openai SDK sends them via
`extra_body`):
  - ignore_eos: bool        keep generating past EOS (benchmarks, tests with random models)
  - top_k: int              0 = off
  - stop_token_ids: [int]
  - return_token_ids: bool  add `token_ids` to each choice / chunk
Every response's `usage` carries `spec_decode`, the request's speculation stats.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.messages import RequestStats, SamplingParams, mean_acceptance_length
from target_proc.validate import RequestError, validate_sampling


class APIError(Exception):
    """An error the server answers with OpenAI's body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # spec-runtime extensions
    ignore_eos: bool = False
    top_k: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    return_token_ids: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for options this runtime does not implement."""
        out = []
        if self.n != 1:
            out.append(("n", "n must be 1 (one completion per request)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        if self.presence_penalty != 0.0:
            out.append(("presence_penalty", "presence_penalty is not supported (must be 0)"))
        if self.frequency_penalty != 0.0:
            out.append(("frequency_penalty", "frequency_penalty is not supported (must be 0)"))
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of is not supported"))
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of prompts is n > 1 in disguise: rejected)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request: send a string or a list of token ids", param="prompt")
            p = p[0]
        if isinstance(p, str) and not p or isinstance(p, list) and not p:
            raise APIError(400, "prompt must be non-empty", param="prompt")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part type {part.get('type')!r} is not supported (text only)",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs is not supported"))
        if self.tools:
            out.append(("tools", "tools are not supported"))
        return out

    def chat_messages(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages must be non-empty", param="messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_request(cls: type[_Common], body: Any) -> _Common:
    """Validate a decoded JSON body; APIError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None
    for param, why in req.unsupported():
        raise APIError(400, why, param=param, code="unsupported_parameter")
    return req


def to_sampling(req: _Common, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """SamplingParams for a parsed request whose prompt has `num_prompt_tokens` tokens."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None:  # chat without a limit: the rest of the context
        max_tokens = max(1, max_model_len - num_prompt_tokens)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                        seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids),
                        ignore_eos=req.ignore_eos)
    try:
        validate_sampling(sp)
    except RequestError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param if param in type(req).model_fields else None) from None
    return sp


# ---------------------------------------------------------------- responses


def spec_decode_usage(stats: RequestStats, mode: str, k: int) -> dict:
    """The per-request speculation stats that ride in `usage.spec_decode`.

    num_drafts counts rounds in which the draft proposed at least one token, so
    mean_acceptance_length = 1 + accepted / drafts lies in [1, K + 1].
    """
    num_drafts = stats.num_drafts
    pos = [round(a / d, 4) if d else 0.0 for a, d in zip(stats.accepted_per_position, stats.drafted_per_position)]
    return {
        "mode": mode,
        "k": k,
        "num_rounds": stats.num_rounds,
        "num_drafts": num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "mean_acceptance_length": round(mean_acceptance_length(stats.num_accepted_tokens, num_drafts), 4),
        "acceptance_rate": (round(stats.num_accepted_tokens / stats.num_draft_tokens, 4)
                            if stats.num_draft_tokens else 0.0),
        "acceptance_per_position": pos,
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        "num_cache_hits": stats.num_cache_hits,
        "num_cache_misses": stats.num_cache_misses,
        "num_ar_fallback_rounds": stats.num_ar_fallback_rounds,
        "engine_ttft_s": round(stats.ttft_s, 6),
        "engine_e2e_s": round(stats.e2e_s, 6),
    }


def stats_from_usage(spec: dict) -> RequestStats:
    """Inverse of spec_decode_usage (what HTTP clients rebuild); latencies are the engine's."""
    return RequestStats(
        num_rounds=spec.get("num_rounds", 0), num_draft_tokens=spec.get("num_draft_tokens", 0),
        num_accepted_tokens=spec.get("num_accepted_tokens", 0),
        accepted_per_position=list(spec.get("accepted_per_position", [])),
        drafted_per_position=list(spec.get("drafted_per_position", [])),
        num_cache_hits=spec.get("num_cache_hits", 0), num_cache_misses=spec.get("num_cache_misses", 0),
        num_ar_fallback_rounds=spec.get("num_ar_fallback_rounds", 0),
        ttft_s=spec.get("engine_ttft_s", 0.0), e2e_s=spec.get("engine_e2e_s", 0.0),
    )


def usage_body(num_prompt: int, num_completion: int, spec: dict | None) -> dict:
    u = {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}
    if spec is not None:
        u["spec_decode"] = spec
    return u


def openai_finish_reason(reason: str | None) -> str | None:
    # "abort" only reaches a client that is still reading after a server-side abort.
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason or "", reason)


class ResponseIds:
    """id / created / object fields of one response and its chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None, *, chunk: bool,
               first: bool = False) -> dict:
        if self.chat:
            if chunk:
                delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                c = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}
        else:
            c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            c["token_ids"] = token_ids
        return c
