"""OpenAI request models and their validation into SamplingParams.

Everything here runs before a request reaches the engine: a request that fails gets
HTTP 400 with OpenAI's error body naming the field, and is never submitted.

Nothing is silently ignored. Every field of OpenAI's chat and completions schemas is
either implemented, or refused by name with a 400 when it is set to anything but its
no-op value, or one of NO_OP_FIELDS: fields that change nothing a self-hosted server
without accounts, storage or moderation returns. A field in neither schema, nor in the
extensions below, is refused by name too (extra="forbid").

Extensions (vLLM's names; the openai SDK sends them via `extra_body`):
  - top_k: int (0 = off), min_p, min_tokens, repetition_penalty
  - stop_token_ids: [int], ignore_eos, skip_special_tokens, include_stop_str_in_output
  - return_token_ids: bool  add `token_ids` to each choice / chunk
  - prompt_logprobs: int    the prompt tokens' logprobs with this many alternatives, as
    vLLM returns them (completions: in each choice; chat: in the response); not streamed
  - chat only: echo, add_generation_prompt, continue_final_message, chat_template_kwargs
  - structured outputs: structured_outputs, guided_json, guided_regex, guided_choice,
    guided_grammar, guided_decoding_backend (checked by openai_structured); chat's tools
    and tool_choice are checked by tool_calls
Every response's `usage` carries `spec_decode`, the request's speculation stats.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.messages import SamplingParams, StructuredOutputs
from spec_runtime.server.errors import APIError
from spec_runtime.validate import MAX_TOP_LOGPROBS, RequestError, validate_sampling

# Accepted and ignored, with why ignoring them changes no output.
NO_OP_FIELDS = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags for stored completions (nothing is stored)",
    "store": "whether the provider stores the completion (nothing is stored)",
    "service_tier": "the provider's billing tier",
    "prompt_cache_key": "a routing hint for the provider's prompt cache",
    "prompt_cache_retention": "the lifetime of the provider's prompt cache",
    "prompt_cache_options": "breakpoints of the provider's prompt cache",
    "prediction": "predicted output, a latency hint that never changes the output",
}
MAX_N = 64

# Fields whose every non-default value is refused, with the reason given in the 400.
_FUNCTIONS = "the deprecated functions / function_call are not supported: use tools and tool_choice"
REFUSED_FIELDS = {
    "functions": _FUNCTIONS, "function_call": _FUNCTIONS,
    "audio": "audio output is not supported",
    "reasoning_effort": "reasoning_effort is not supported (pass chat_template_kwargs, e.g. enable_thinking)",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "suffix": "suffix (insertion) is not supported",
}
# vLLM request fields that are refused by name with their reason (any other unknown
# field gets the generic "unsupported parameter" 400).
_VLLM_REFUSED = {
    "use_beam_search": "beam search is not supported", "chat_template": "a per-request chat_template is not supported",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no-op: padding against length side channels


class _Common(_Strict):
    """Fields shared by both endpoints. None means "the default" where OpenAI allows null."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # NO_OP_FIELDS
    user: Any = None
    safety_identifier: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    prediction: Any = None
    # Extensions
    ignore_eos: bool = False
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    # Structured outputs (openai_structured reads and checks them)
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for fields set to something this runtime does not implement."""
        out = [(name, why) for name, why in REFUSED_FIELDS.items()
               if name in type(self).model_fields and getattr(self, name) not in (None, False, "", [])]
        if self.prompt_logprobs is not None and self.stream:
            out.append(("prompt_logprobs", "prompt_logprobs are not available when stream=true (as in vLLM)"))
        return out

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: no prompt logprobs)."""
        return self.prompt_logprobs

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.best_of is not None and self.best_of != self.num_choices:
            out.append(("best_of", "best_of must equal n (ranking extra samples is not supported)"))
        return out

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs lists the prompt's tokens first, with their logprobs (vLLM
        takes the prompt's alternatives from prompt_logprobs when given, else logprobs)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a string, token ids, or a list of either."""
        p = self.prompt
        prompts = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if any(not x for x in prompts):
            raise APIError(400, "prompt must be non-empty", param="prompt")
        return prompts


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Refused when set: they carry what this runtime cannot put into a prompt.
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None

    def text(self, where: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") not in ("text", "refusal"):
                raise APIError(400, f"{where}.content: content part type {part.get('type')!r} is not supported "
                               f"(text only)", param=f"{where}.content")
            parts.append(str(part.get("text", part.get("refusal", ""))))
        return "\n".join(parts)  # as vLLM joins text parts

    def template_dict(self, where: str) -> dict:
        """The message as a chat template receives it (vLLM's conventions: tool-call
        arguments parsed from their JSON string into an object)."""
        for name in ("refusal", "audio", "function_call"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{where}.{name} is not supported in messages", param=f"{where}.{name}",
                               code="unsupported_parameter")
        msg: dict[str, Any] = {"role": self.role, "content": self.text(where)}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                               param=f"{where}.tool_calls")
            calls = []
            for i, call in enumerate(self.tool_calls):
                try:
                    args = json.loads(call.function.arguments)
                except ValueError:
                    raise APIError(400, f"{where}.tool_calls.{i}.function.arguments is not valid JSON",
                                   param=f"{where}.tool_calls.{i}.function.arguments") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if self.role == "tool":
            if self.tool_call_id is None:
                raise APIError(400, f"{where}.tool_call_id is required for role 'tool'", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = self.tool_call_id
        elif self.tool_call_id is not None:
            raise APIError(400, f"{where}.tool_call_id belongs to role 'tool' messages", param=f"{where}.tool_call_id")
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tool_choice: Any = None
    modalities: list[str] | None = None
    tools: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # Extensions (vLLM's)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.modalities not in (None, ["text"]):
            out.append(("modalities", "only the text modality is supported"))
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.continue_final_message and self.add_generation_prompt:
            out.append(("continue_final_message", "continue_final_message needs add_generation_prompt: false"))
        return out

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages must be non-empty", param="messages")
        return [m.template_dict(f"messages.{i}") for i, m in enumerate(self.messages)]

    def template_kwargs(self) -> dict:
        kw = dict(self.chat_template_kwargs or {})
        clash = {"messages", "add_generation_prompt", "continue_final_message", "tokenize", "tools",
                 "chat_template"} & set(kw)
        if clash:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs")
        kw.update(add_generation_prompt=self.add_generation_prompt, continue_final_message=self.continue_final_message)
        return kw


def parse_request(cls: type[_Common], body: Any) -> _Common:
    """Validate a decoded JSON body; APIError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(body, strict=True)  # no "10" as an int, no true as a token id
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            why = _VLLM_REFUSED.get(param, "spec-runtime does not implement it")
            raise APIError(400, f"unsupported parameter {param!r}: {why}", param=param,
                           code="unsupported_parameter") from None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None
    for param, why in req.unsupported():
        raise APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")
    top = req.num_top_logprobs()
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise APIError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param=param)
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.prompt_logprobs}",
                       param="prompt_logprobs")
    if not 1 <= req.num_choices <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    return req


def to_sampling(req: _Common, num_prompt_tokens: int, max_model_len: int, *,
                structured: StructuredOutputs | None = None,
                skip_special_tokens: bool | None = None) -> SamplingParams:
    """SamplingParams for a parsed request whose prompt has `num_prompt_tokens` tokens;
    `structured` is its checked constraint; skip_special_tokens overrides the request's."""
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
    if req.seed is not None and not 0 <= req.seed + req.num_choices - 1 < 2**63:
        raise APIError(400, f"seed must be in [0, 2**63 - n], got {req.seed}", param="seed")
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        bias[int(key)] = value
    top = req.num_top_logprobs()

    def given(value, default):
        return default if value is None else value

    sp = SamplingParams(
        max_tokens=max_tokens, temperature=given(req.temperature, 1.0), top_k=given(req.top_k, 0),
        top_p=given(req.top_p, 1.0), seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=top is not None,
        top_logprobs=top or 0, presence_penalty=given(req.presence_penalty, 0.0),
        frequency_penalty=given(req.frequency_penalty, 0.0), repetition_penalty=given(req.repetition_penalty, 1.0),
        min_p=given(req.min_p, 0.0), min_tokens=req.min_tokens, logit_bias=bias,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, structured=structured,
        prompt_logprobs=req.num_prompt_logprobs(),
    )
    try:
        validate_sampling(sp)
    except RequestError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param if param in type(req).model_fields else None) from None
    return sp
