"""FastAPI app of `spec-runtime serve`: OpenAI-compatible endpoints over an AsyncClient.

    POST /v1/completions, /v1/chat/completions   (SSE when stream=true, ending `data: [DONE]`)
    GET  /v1/models
    GET  /v1/engine_stats                        (spec-runtime extension: EngineStats as JSON)
    GET  /health                                 (503 when a child process is dead)
    GET  /metrics                                (Prometheus text)

Requests are parsed, tokenized and validated here (openai_protocol) before anything is
submitted, so a bad request never reaches target_proc. A client that disconnects, while
streaming or while waiting for a whole response, gets its request aborted: target_proc
frees the slot and releases the draft's state, and the aborted request still counts in
the metrics once its final output arrives.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol.messages import EngineStats, RequestOutput
from spec_runtime.client import RequestFailed
from spec_runtime.server.async_client import AsyncClient, AsyncRequest
from spec_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from spec_runtime.server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    to_sampling,
)
from spec_runtime.server.openai_responses import Choice, ResponseIds, merge_stats, spec_decode_usage, usage_body

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20  # larger bodies get 413


class _Tracker:
    """Latencies and token count of one request, recorded into the metrics at its end."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.token_ids: list[int] = []

    def on_output(self, out: RequestOutput) -> None:
        if out.new_token_ids:
            now = time.monotonic()
            if self.first is None:
                self.first = now
            else:
                self.metrics.observe_chunk_gap(now - self.last)
            self.last = now
            self.token_ids.extend(out.new_token_ids)
        if out.finished and out.stats is not None:
            ttft = self.first - self.arrival if self.first is not None else None
            self.metrics.observe_finished(out.stats, out.finish_reason, ttft, time.monotonic() - self.arrival,
                                          len(self.token_ids))


class _Server:
    """Route bodies: checks, tokenization, submission, and response shaping over one AsyncClient."""

    def __init__(self, client: AsyncClient, served_model_name: str, api_key: str | None, max_body_bytes: int,
                 metrics: ServerMetrics | None = None):
        self.client = client
        self.model = served_model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        ready = client.client.ready
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = list(ready.eos_token_ids)
        cfg = client.config
        self.mode, self.k = cfg.spec.mode, (cfg.spec.k if cfg.spec.mode != "ar" else 0)
        self.metrics = metrics or ServerMetrics(served_model_name, self.k)
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ checks

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(self, request: Request):
        limit = self.max_body_bytes
        too_big = APIError(413, f"the request body is over the {limit}-byte limit", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise too_big
        try:
            return json.loads(buf)
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(400, f"The model `{name}` does not exist; this server serves `{self.model}`.",
                           param="model", code="model_not_found")

    def check_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size}), got {bad[0]}", param="prompt")

    # ------------------------------------------------------------------ generation

    async def completion(self, request: Request, chat: bool):
        self.check_auth(request)
        body = await self.read_json(request)
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
        self.check_model(req.model)
        prompts, echoes = self._prompts(req, chat)
        sps = []
        for ids in prompts:  # every prompt is checked before any is submitted
            self.check_prompt_ids(ids)
            sp = to_sampling(req, len(ids), self.max_model_len)
            for name, ids_ in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", list(sp.logit_bias))):
                for t in ids_:
                    if not 0 <= t < self.vocab_size:
                        raise APIError(400, f"{name}: token id {t} is outside [0, {self.vocab_size})", param=name)
            sps.append(sp)
        rids = ResponseIds(chat, self.model)
        n, num_top = req.num_choices, req.num_top_logprobs()
        tokenizer = self._tokenizer("logprobs") if num_top is not None else None
        areqs, trackers, choices = [], [], []
        try:
            for p, (ids, sp) in enumerate(zip(prompts, sps)):
                for j in range(n):  # n samples of a prompt: seeds seed, seed + 1, ... when given
                    sp_j = sp if sp.seed is None or j == 0 else msgspec.structs.replace(sp, seed=sp.seed + j)
                    areqs.append(self.client.submit(ids, sp_j))
                    trackers.append(_Tracker(self.metrics))
                    choices.append(Choice(p * n + j, chat, tokenizer, num_top=num_top, echo=echoes[p],
                                          return_token_ids=req.return_token_ids))
        except RequestFailed as e:  # the runtime refuses work (its target died, or it is closing)
            for a in areqs:
                a.abort()
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        num_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            gen = self._sse(areqs, trackers, choices, rids, num_prompt, req.include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await self._whole(request, areqs, trackers, choices, rids, num_prompt)

    def _prompts(self, req, chat: bool) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt, and the text `echo` puts before each one's output."""
        client = self.client.client
        if chat:
            messages, kwargs = req.chat_messages(), req.template_kwargs()
            try:
                ids = client.encode_chat(messages, **kwargs)
            except Exception as e:  # no chat template, or the template refused these messages
                raise APIError(400, f"the chat template failed: {e}", param="messages") from None
            last = messages[-1]
            echo = last["content"] if req.echo and last["role"] == "assistant" else ""
            return [ids], [echo]
        prompts = req.prompts()
        try:
            ids = [client.encode_prompt(p) for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        if not req.echo:
            return ids, [""] * len(ids)
        return ids, [p if isinstance(p, str) else self._tokenizer("echo").decode(p) for p in prompts]

    def _tokenizer(self, param: str):
        """The model's tokenizer; a 400 naming `param` where the model has none."""
        try:
            return self.client.client.tokenizer
        except (OSError, ValueError) as e:  # e.g. a random-weight benchmark model
            raise APIError(400, f"{param} needs the model's tokenizer: {e}", param=param) from None

    def _usage(self, num_prompt: int, choices: list[Choice]) -> dict:
        stats = [c.final.stats for c in choices if c.final is not None and c.final.stats is not None]
        spec = spec_decode_usage(merge_stats(stats), self.mode, self.k) if stats else None
        return usage_body(num_prompt, sum(len(c.token_ids) for c in choices), spec)

    @staticmethod
    async def _consume(areq: AsyncRequest, tracker: _Tracker, choice: Choice) -> None:
        async for out in areq:
            tracker.on_output(out)
            choice.add(out)

    async def _whole(self, request: Request, areqs: list[AsyncRequest], trackers: list[_Tracker],
                     choices: list[Choice], rids: ResponseIds, num_prompt: int):
        work = asyncio.ensure_future(asyncio.gather(*(self._consume(a, t, c)
                                                      for a, t, c in zip(areqs, trackers, choices))))
        gone = asyncio.create_task(_wait_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            logger.info("client went away; aborting %s", ", ".join(a.request_id for a in areqs))
            for a in areqs:
                a.abort()
            self._keep(work)  # they still end (finish_reason "abort") and are counted
            return Response(status_code=499)
        gone.cancel()
        try:
            work.result()
        except RequestFailed as e:
            for a in areqs:  # the other choices' requests still end and are counted
                a.abort()
            raise _engine_error(e) from None
        body = rids.head(chunk=False)
        body["choices"] = [c.whole() for c in choices]
        body["usage"] = self._usage(num_prompt, choices)
        return JSONResponse(body)

    async def _sse(self, areqs: list[AsyncRequest], trackers: list[_Tracker], choices: list[Choice],
                   rids: ResponseIds, num_prompt: int, include_usage: bool):
        try:
            async for i, out in _merged(areqs):
                trackers[i].on_output(out)
                if not (out.new_token_ids or out.text_delta or out.finished):
                    continue
                chunk = rids.head(chunk=True)
                chunk["choices"] = [choices[i].add(out)]
                if include_usage:
                    chunk["usage"] = None
                yield _event(chunk)
            if include_usage:
                chunk = rids.head(chunk=True)
                chunk["choices"] = []
                chunk["usage"] = self._usage(num_prompt, choices)
                yield _event(chunk)
        except RequestFailed as e:
            err = _engine_error(e)
            yield _event(err.body())
        finally:
            for areq, tracker in zip(areqs, trackers):
                if not areq.finished:  # the client disconnected, or another choice failed
                    logger.info("stream closed early; aborting %s", areq.request_id)
                    areq.abort()
                    self._keep(asyncio.ensure_future(self._drain(areq, tracker)))
        yield "data: [DONE]\n\n"

    async def _drain(self, areq: AsyncRequest, tracker: _Tracker) -> None:
        final = await areq.drain()
        if final is not None:
            tracker.on_output(final)

    def _keep(self, task: asyncio.Future) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ info

    def models(self) -> dict:
        cfg = self.client.config
        return {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "spec-runtime",
            "root": cfg.target.path, "max_model_len": self.max_model_len,
            "spec_runtime": {"mode": self.mode, "k": self.k, "draft": cfg.draft_name if self.mode != "ar" else None,
                             "vocab_size": self.vocab_size, "eos_token_ids": self.eos_token_ids},
        }]}

    async def engine_stats(self, timeout_s: float = 5.0):
        try:
            return await asyncio.wait_for(self.client.engine_stats(), timeout_s)
        except (RequestFailed, asyncio.TimeoutError) as e:
            logger.warning("no engine stats: %s", e)
            return None


def engine_stats_dict(st: EngineStats) -> dict:
    # The Structs are array_like (positional on the wire); name the fields for JSON.
    d = msgspec.structs.asdict(st)
    d["totals"] = msgspec.structs.asdict(st.totals)
    return d


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _merged(areqs: list[AsyncRequest]):
    """(index, RequestOutput) of several requests as they arrive, until all have finished."""
    if len(areqs) == 1:
        async for out in areqs[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, areq: AsyncRequest) -> None:
        try:
            async for out in areq:
                queue.put_nowait((i, out))
        except RequestFailed as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, a)) for i, a in enumerate(areqs)]
    try:
        left = len(areqs)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            left -= item.finished
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or nothing).
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _engine_error(e: RequestFailed) -> APIError:
    msg = str(e)
    if msg.startswith("bad_request"):
        return APIError(400, msg)
    return APIError(500, msg, type="server_error", code="internal_error")


def model_name_of(cfg, served_model_name: str | None = None) -> str:
    """The name clients send in `model`: --served-model-name, else the target path."""
    return served_model_name or cfg.target.path or "SmolLM2-135M-Instruct"


def build_app(client: AsyncClient, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app over a started AsyncClient (the caller owns and closes the client).
    metrics: the ServerMetrics to record into (default: a fresh one, named after the model)."""
    name = model_name_of(client.config, served_model_name)
    srv = _Server(client, name, api_key, max_body_bytes, metrics)
    app = FastAPI(title="spec-runtime", docs_url=None, redoc_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException):
        err = APIError(e.status_code, str(e.detail), code=None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await srv.completion(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.check_auth(request)
        return srv.models()

    @app.get("/v1/engine_stats")
    async def engine_stats(request: Request):
        srv.check_auth(request)
        st = await srv.engine_stats()
        if st is None:
            raise APIError(503, "the engine did not answer", type="server_error")
        return engine_stats_dict(st)

    @app.get("/health")
    async def health():
        dead = client.client.launcher.dead_child()
        if dead is not None:
            return JSONResponse({"status": "unhealthy", "dead_process": dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        restarts = getattr(srv.client.client.launcher, "num_draft_restarts", 0)
        return Response(srv.metrics.render(await srv.engine_stats(), restarts), media_type=CONTENT_TYPE)

    return app
