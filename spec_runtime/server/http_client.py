"""HTTPClient / AsyncHTTPClient: the Client API against a running `spec-runtime serve`.

`Client.connect(url)` and `AsyncClient.connect(url)` return these. They speak the
server's OpenAI API (plus its extensions: return_token_ids, ignore_eos, top_k,
stop_token_ids) and rebuild the same results the in-process clients return:
GenerationResult with token ids, finish reason and RequestStats (from
`usage.spec_decode`), and RequestOutput chunks when streaming (the final chunk carries
the stats). Logprobs of the sampled tokens come back when SamplingParams.logprobs is set.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Iterator

import httpx

from protocol.messages import EngineStats, PromptLogprobs, RequestOutput, RequestStats, SamplingParams
from spec_runtime.results import GenerationResult, RequestFailed
from spec_runtime.server.openai_responses import stats_from_usage


class ServerError(RequestFailed):
    """The server answered with an HTTP error (OpenAI's body): `status` is the HTTP status
    (an int), `code` the body's error code (OpenAI's are strings, e.g. "internal_error")."""

    def __init__(self, status: int, message: str, code: str | int | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.code = code


def _stream_error(err: dict) -> ServerError:
    """The error event of a stream whose HTTP status was already 200: the status it stands
    for is the body's code where that is an int (vLLM's), else the one its type implies."""
    code = err.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        status = code
    else:
        status = 400 if err.get("type") == "invalid_request_error" else 500
    return ServerError(status, err.get("message", ""), code)


def _body(model: str, prompt, sp: SamplingParams, chat: bool, stream: bool) -> tuple[str, dict]:
    if chat or isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        if not isinstance(prompt, list):
            prompt = [{"role": "user", "content": prompt}]
        elif not isinstance(prompt[0], dict):
            raise ValueError("a chat request takes a string or a list of messages, not token ids")
        path, body = "/v1/chat/completions", {"messages": prompt}
    else:
        path, body = "/v1/completions", {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt]}
    body.update(model=model, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                seed=sp.seed, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                return_token_ids=True, stream=stream, presence_penalty=sp.presence_penalty,
                frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty, min_p=sp.min_p,
                min_tokens=sp.min_tokens, logit_bias={str(t): b for t, b in sp.logit_bias.items()},
                skip_special_tokens=sp.skip_special_tokens, include_stop_str_in_output=sp.include_stop_str_in_output)
    if sp.logprobs:
        if path == "/v1/chat/completions":
            body.update(logprobs=True, top_logprobs=sp.top_logprobs)
        else:
            body["logprobs"] = sp.top_logprobs
    if sp.prompt_logprobs is not None:
        body["prompt_logprobs"] = sp.prompt_logprobs  # the server refuses it when streaming, as vLLM does
    if stream:
        body["stream_options"] = {"include_usage": True}
    return path, body


def _stats(body: dict) -> RequestStats:
    usage = body.get("usage") or {}
    st = stats_from_usage(usage.get("spec_decode") or {})
    st.num_prompt_tokens = usage.get("prompt_tokens", 0)
    st.num_generated_tokens = usage.get("completion_tokens", 0)
    st.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return st


def _logprobs(choice: dict) -> list[float]:
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return [e["logprob"] for e in lp["content"] or []]
    return list(lp.get("token_logprobs") or [])


def _prompt_logprobs(entries: list | None, num_top: int | None) -> PromptLogprobs | None:
    """PromptLogprobs from vLLM's prompt_logprobs list (None, then per token a dict whose
    first entry is the prompt's own token, with ranks for every entry)."""
    if entries is None or num_top is None:
        return None
    out = PromptLogprobs()
    for d in entries[1:]:
        own = next(iter(d.values()))
        out.logprobs.append(own["logprob"])
        out.ranks.append(own["rank"])
        if num_top:
            top = sorted(((v["rank"], int(k), v["logprob"]) for k, v in d.items() if v["rank"] <= num_top))
            out.top_token_ids.append([t for _, t, _ in top])
            out.top_logprobs.append([lp for _, _, lp in top])
    return out


def _result(body: dict, sp: SamplingParams) -> GenerationResult:
    c = body["choices"][0]
    text = c["message"]["content"] if "message" in c else c["text"]
    plp = body.get("prompt_logprobs", c.get("prompt_logprobs"))  # chat: the response's; completions: the choice's
    return GenerationResult(text or "", list(c.get("token_ids") or []), c.get("finish_reason"), _stats(body),
                            _logprobs(c), _prompt_logprobs(plp, sp.prompt_logprobs))


def _error(status: int, raw: bytes) -> ServerError:
    try:
        err = json.loads(raw)["error"]
        msg, code = err["message"], err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        msg, code = raw.decode(errors="replace")[:500], None
    return ServerError(status, msg, code)


class _SSEParser:
    """Turns `data:` lines into RequestOutput; the finished chunk is held until the usage arrives."""

    def __init__(self):
        self.held: RequestOutput | None = None

    def feed(self, line: str) -> list[RequestOutput]:
        if not line.startswith("data:"):
            return []
        data = line[5:].strip()
        if data == "[DONE]":
            out, self.held = self.held, None
            return [out] if out is not None else []
        obj = json.loads(data)
        if "error" in obj:
            raise _stream_error(obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])})
        if not obj.get("choices"):  # the usage chunk
            if self.held is not None and obj.get("usage"):
                self.held.stats = _stats(obj)
            return []
        c = obj["choices"][0]
        text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
        reason = c.get("finish_reason")
        out = RequestOutput(request_id=obj.get("id", ""), new_token_ids=list(c.get("token_ids") or []),
                            text_delta=text or "", finished=reason is not None, finish_reason=reason,
                            logprobs=_logprobs(c), stop_reason=c.get("stop_reason"))
        if out.finished:
            self.held = out
            return []
        return [out]


def _engine_stats(d: dict) -> EngineStats:
    d = dict(d)
    d["totals"] = RequestStats(**d["totals"])
    return EngineStats(**d)


class HTTPClient:
    """Blocking client of a running server: generate, stream, chat, generate_batch, engine_stats."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._get("/v1/models")["data"][0]["id"]
        return self._model

    def _get(self, path: str) -> dict:
        r = self._http.get(path)
        if r.status_code != 200:
            raise _error(r.status_code, r.content)
        return r.json()

    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        if r.status_code != 200:
            raise _error(r.status_code, r.content)
        return r.json()

    def generate(self, prompt, sampling: SamplingParams | None = None, *, chat: bool = False, **kw) -> GenerationResult:
        sp = sampling or SamplingParams(**kw)
        path, body = _body(self.model, prompt, sp, chat, stream=False)
        return _result(self._post(path, body), sp)

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        return self.generate(messages, sampling, chat=True, **kw)

    def generate_batch(self, prompts: list, sampling: SamplingParams | None = None, *, chat: bool = False,
                       **kw) -> list[GenerationResult]:
        """All prompts in flight at once (one thread each), so the server batches them."""
        from concurrent.futures import ThreadPoolExecutor

        sp = sampling or SamplingParams(**kw)
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(lambda p: self.generate(p, sp, chat=chat), prompts))

    def stream(self, prompt, sampling: SamplingParams | None = None, *, chat: bool = False,
               **kw) -> Iterator[RequestOutput]:
        path, body = _body(self.model, prompt, sampling or SamplingParams(**kw), chat, stream=True)
        parser = _SSEParser()
        with self._http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise _error(r.status_code, r.read())
            for line in r.iter_lines():
                yield from parser.feed(line)

    def engine_stats(self) -> EngineStats:
        return _engine_stats(self._get("/v1/engine_stats"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "HTTPClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncHTTPClient:
    """asyncio client of a running server, with AsyncClient's methods."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                       limits=limits)
        self._model = model

    async def model(self) -> str:
        if self._model is None:
            self._model = (await self._get("/v1/models"))["data"][0]["id"]
        return self._model

    async def _get(self, path: str) -> dict:
        r = await self._http.get(path)
        if r.status_code != 200:
            raise _error(r.status_code, r.content)
        return r.json()

    async def generate(self, prompt, sampling: SamplingParams | None = None, *, chat: bool = False,
                       **kw) -> GenerationResult:
        sp = sampling or SamplingParams(**kw)
        path, body = _body(await self.model(), prompt, sp, chat, stream=False)
        r = await self._http.post(path, json=body)
        if r.status_code != 200:
            raise _error(r.status_code, r.content)
        return _result(r.json(), sp)

    async def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        return await self.generate(messages, sampling, chat=True, **kw)

    async def generate_batch(self, prompts: list, sampling: SamplingParams | None = None, *, chat: bool = False,
                             **kw) -> list[GenerationResult]:
        import asyncio

        sp = sampling or SamplingParams(**kw)
        return list(await asyncio.gather(*(self.generate(p, sp, chat=chat) for p in prompts)))

    async def stream(self, prompt, sampling: SamplingParams | None = None, *, chat: bool = False,
                     **kw) -> AsyncIterator[RequestOutput]:
        path, body = _body(await self.model(), prompt, sampling or SamplingParams(**kw), chat, stream=True)
        parser = _SSEParser()
        async with self._http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise _error(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                for out in parser.feed(line):
                    yield out

    async def engine_stats(self) -> EngineStats:
        return _engine_stats(await self._get("/v1/engine_stats"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncHTTPClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
