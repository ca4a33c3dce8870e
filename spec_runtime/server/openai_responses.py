"""OpenAI response bodies: choices (whole and streamed) with logprobs, usage, ids.

A response holds one choice per (prompt, sample): n choices per prompt, indexed
prompt * n + sample as vLLM does. Each `Choice` follows one engine request, turns its
RequestOutput chunks into OpenAI chunks, and gathers them for a whole response.
"""

from __future__ import annotations

import time
import uuid

from protocol.messages import PromptLogprobs, RequestOutput, RequestStats, add_totals, mean_acceptance_length
from spec_runtime.server.tool_calls import ToolRequest, call_body, safe_content_len

# JSON has no -inf; vLLM reports logprobs below this as this.
_MIN_LOGPROB = -9999.0


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
        "num_sd_rounds": stats.num_sd_rounds,
        "num_plain_rounds": stats.num_plain_rounds,
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
        num_sd_rounds=spec.get("num_sd_rounds", 0), num_plain_rounds=spec.get("num_plain_rounds", 0),
        ttft_s=spec.get("engine_ttft_s", 0.0), e2e_s=spec.get("engine_e2e_s", 0.0),
    )


def merge_stats(stats: list[RequestStats]) -> RequestStats:
    """The stats of several requests (the choices of one response) as one: counters add up,
    TTFT is the first choice's, e2e the last one's."""
    if len(stats) == 1:
        return stats[0]
    k = len(stats[0].accepted_per_position)
    total = RequestStats(accepted_per_position=[0] * k, drafted_per_position=[0] * k)
    for st in stats:
        add_totals(total, st)
    total.ttft_s = min(st.ttft_s for st in stats)
    total.e2e_s = max(st.e2e_s for st in stats)
    return total


def usage_body(num_prompt: int, num_completion: int, spec: dict | None, num_cached: int | None = None) -> dict:
    """OpenAI's usage object; num_cached: prompt tokens the prefix cache held (None: unknown)."""
    u = {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}
    if num_cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": num_cached}
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


class Choice:
    """One choice of a response, fed the RequestOutputs of its engine request.

    num_top: None without logprobs, else the alternatives per token. echo: text that
    precedes the generated text (the prompt for completions; for chat, the final
    assistant message being continued). tools, parser: a chat request's tools and the
    parser of its calls; text that may be part of a call is held back while streaming,
    and the calls go out with the final chunk.

    Prompt logprobs (the engine's PromptLogprobs, on a request's first output; a whole
    response's later samples of a prompt read its first sample's, `first_sample`): with
    echo_logprobs (completions' echo with logprobs) the prompt's tokens lead the choice's
    `logprobs`, the first without a logprob; with prompt_top (vLLM's prompt_logprobs) the
    choice carries vLLM's `prompt_logprobs` list. Both need prompt_ids.
    """

    def __init__(self, index: int, chat: bool, tokenizer, *, num_top: int | None = None, echo: str = "",
                 return_token_ids: bool = False, tools: ToolRequest | None = None, parser: str | None = None,
                 prompt_ids: list[int] | None = None, echo_logprobs: bool = False, prompt_top: int | None = None,
                 first_sample: "Choice | None" = None):
        self.index, self.chat, self.tokenizer = index, chat, tokenizer
        self.num_top, self.echo, self.return_token_ids = num_top, echo, return_token_ids
        self.prompt_ids = prompt_ids
        self.prompt_top = prompt_top
        self._prompt_lp: PromptLogprobs | None = None
        self.first_sample = first_sample
        # Completions' echo with logprobs: the prompt's token strings, listed first.
        self.prompt_tokens = [self._token(t) for t in prompt_ids] if echo_logprobs and num_top is not None else None
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.parser = parser
        self.raw = ""  # generated text (tools): what the parser reads
        self.num_sent = 0  # characters of `raw` sent as content
        self.tool_calls: list[dict] = []
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # chat: content entries; completions: one dict per token
        # completions' text_offset of the next token (after the echoed prompt's tokens)
        self.offset = len(echo) if self.prompt_tokens is None else sum(map(len, self.prompt_tokens))
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.started = False
        self.final: RequestOutput | None = None

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _logprobs(self, out: RequestOutput) -> list:
        """The logprob entries of out's tokens, in this endpoint's format."""
        if self.num_top is None:
            return []
        entries = []
        for i, (tid, lp) in enumerate(zip(out.new_token_ids, out.logprobs)):
            tok, lp = self._token(tid), max(lp, _MIN_LOGPROB)
            alts = list(zip(out.top_token_ids[i], out.top_logprobs[i])) if i < len(out.top_token_ids) else []
            if self.chat:
                entries.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                "top_logprobs": [{"token": (t := self._token(a)), "logprob": max(b, _MIN_LOGPROB),
                                                  "bytes": list(t.encode())} for a, b in alts]})
            else:
                # OpenAI: the sampled token is always listed. Tokens whose strings coincide
                # (partial UTF-8) keep the sampled one's, then the most likely one's logprob.
                top = {tok: lp}
                for a, b in alts:
                    top.setdefault(self._token(a), max(b, _MIN_LOGPROB))
                entries.append({"token": tok, "logprob": lp, "top": top, "offset": self.offset})
                self.offset += len(tok)
        return entries

    @property
    def prompt_lp(self) -> PromptLogprobs | None:
        if self._prompt_lp is None and self.first_sample is not None:
            return self.first_sample.prompt_lp
        return self._prompt_lp

    def _prompt_entries(self) -> list:
        """Completions' logprob entries of the echoed prompt: the first token has none."""
        plp = self.prompt_lp
        if self.prompt_tokens is None or plp is None:
            return []
        entries, offset = [], 0
        for i, tok in enumerate(self.prompt_tokens):
            if i == 0:
                entries.append({"token": tok, "logprob": None, "top": None, "offset": 0})
            else:
                lp = max(plp.logprobs[i - 1], _MIN_LOGPROB)
                top = {tok: lp}
                if plp.top_token_ids:
                    for a, b in zip(plp.top_token_ids[i - 1][: self.num_top], plp.top_logprobs[i - 1]):
                        top.setdefault(self._token(a), max(b, _MIN_LOGPROB))
                entries.append({"token": tok, "logprob": lp, "top": top, "offset": offset})
            offset += len(tok)
        return entries

    def vllm_prompt_logprobs(self) -> list | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then for each token a
        dict of token id -> {logprob, rank, decoded_token}: the token itself first, then the
        prompt_top most likely ones (ranks 1..prompt_top)."""
        plp = self.prompt_lp
        if self.prompt_top is None or plp is None:
            return None
        out: list = [None]
        for i, tid in enumerate(self.prompt_ids[1:]):
            d = {tid: {"logprob": max(plp.logprobs[i], _MIN_LOGPROB), "rank": plp.ranks[i],
                       "decoded_token": self._token(tid)}}
            if plp.top_token_ids:
                alts = zip(plp.top_token_ids[i][: self.prompt_top], plp.top_logprobs[i])
                for rank, (a, b) in enumerate(alts, start=1):
                    d.setdefault(a, {"logprob": max(b, _MIN_LOGPROB), "rank": rank, "decoded_token": self._token(a)})
            out.append({str(k): v for k, v in d.items()})
        return out

    def _logprobs_body(self, entries: list) -> dict | None:
        if self.num_top is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": [e["offset"] for e in entries]}

    def add(self, out: RequestOutput) -> dict:
        """Record one output; return its streamed choice."""
        if out.prompt_logprobs is not None:
            self._prompt_lp = out.prompt_logprobs
        entries = self._logprobs(out)
        self.logprobs += entries
        if not self.started:
            entries = self._prompt_entries() + entries
        self.token_ids += out.new_token_ids
        text = out.text_delta if self.tools is None else self._tool_text(out)
        if not self.started:
            text = self.echo + text
        self.text.append(text)
        if out.finished:
            self.final = out
            self.finish_reason = openai_finish_reason(out.finish_reason)
            self.stop_reason = out.stop_reason
            if self.tool_calls and self.finish_reason == "stop" and self.tools.choice != "named":
                self.finish_reason = "tool_calls"
        c = {"index": self.index}
        if self.chat:
            c["delta"] = {"role": "assistant", "content": text} if not self.started else {"content": text}
            if out.finished and self.tool_calls:
                c["delta"]["tool_calls"] = [dict(call, index=i) for i, call in enumerate(self.tool_calls)]
        else:
            c["text"] = text
        self.started = True
        return self._tail(c, self._logprobs_body(entries), list(out.new_token_ids), out.finished)

    def _tool_text(self, out: RequestOutput) -> str:
        """The content to send for `out`: what can no longer become part of a call; at the
        end, the rest of the content, with the calls parsed into `tool_calls`."""
        self.raw += out.text_delta
        if out.finished:
            content, calls = self.tools.calls_from(self.raw, self.parser)
            self.tool_calls = [call_body(c) for c in calls]
            end = len(content) if calls else len(self.raw)
        elif self.tools.holds_content():
            end = 0
        else:
            end = safe_content_len(self.parser, self.raw)
        text = self.raw[self.num_sent:end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return text

    def _tail(self, c: dict, logprobs: dict | None, token_ids: list[int], finished: bool) -> dict:
        c["logprobs"] = logprobs
        c["finish_reason"] = self.finish_reason if finished else None
        c["stop_reason"] = self.stop_reason if finished else None
        if self.return_token_ids:
            c["token_ids"] = token_ids
        return c

    def whole(self) -> dict:
        """The choice of a whole (non-streamed) response, after its final output."""
        text = "".join(self.text) if self.started else self.echo
        c: dict = {"index": self.index}
        if self.chat:
            c["message"] = {"role": "assistant", "content": text}
            if self.tool_calls:
                c["message"].update(content=text or None, tool_calls=self.tool_calls)
        else:
            c["text"] = text
            if self.prompt_top is not None:
                c["prompt_logprobs"] = self.vllm_prompt_logprobs()
        return self._tail(c, self._logprobs_body(self._prompt_entries() + self.logprobs), self.token_ids, True)
