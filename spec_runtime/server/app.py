"""FastAPI app of `spec-runtime serve`: OpenAI-compatible endpoints over an AsyncClient.

    POST /v1/completions, /v1/chat/completions   (SSE when stream=true, ending `data: [DONE]`)
    GET  /v1/models, /v1/models/{model}
    GET  /v1/engine_stats                        (spec-runtime extension: EngineStats as JSON)
    GET  /health                                 (ok / degraded: 200; dead: 503)
    GET  /metrics                                (Prometheus text)
    POST /tokenize, /detokenize; GET /version; GET|POST /ping   (vLLM's; server.info_routes)

Requests are checked (request_checks: UTF-8, nesting), parsed strictly (openai_protocol),
tokenized off the event loop and validated before anything is submitted, so a bad
request never reaches target_proc. Every error is OpenAI's JSON body. A client that
disconnects, while streaming or while waiting for a whole response, gets its request
aborted: target_proc frees the slot and releases the draft's state. Every submitted
request ends in the metrics exactly once: with its final output, or as "abort" or
"error" when none comes. On shutdown, `drain()` refuses new requests and
`stop_open_requests()` ends the ones still open (streams with an error event and [DONE]).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol.messages import EngineStats
from spec_runtime.results import RequestFailed
from spec_runtime.server.async_client import AsyncClient
from spec_runtime.server.chat_config import ChatConfig
from spec_runtime.server.flight import EngineStream, InFlight, Tracker
from spec_runtime.server.generation_config import apply_generation_defaults
from spec_runtime.server.http_limits import GuardMiddleware, HTTPConfig
from spec_runtime.server.info_routes import add_info_routes
from spec_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from spec_runtime.server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    to_sampling,
)
from spec_runtime.server.openai_responses import Choice, ResponseIds, merge_stats, spec_decode_usage, usage_body
from spec_runtime.server.openai_structured import constraint_of
from spec_runtime.server.request_checks import check_json_body
from spec_runtime.server.responding import sse_events, whole_response
from spec_runtime.server.tool_calls import ToolRequest, tool_parser, tool_request

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = HTTPConfig.max_body_bytes  # larger bodies get 413


class _Server:
    """Route bodies: checks, tokenization, submission, and response shaping over one AsyncClient."""

    def __init__(self, client: AsyncClient, served_model_name: str, api_key: str | None, http: HTTPConfig,
                 metrics: ServerMetrics | None = None, metrics_prefix: str = "spec_runtime",
                 generation_defaults: dict | None = None, chat: ChatConfig | None = None):
        self.client = client
        self.chat = chat or ChatConfig()
        self.chat_template = self.chat.template_text()
        self.model = served_model_name
        self.api_key = api_key
        self.http = http
        self.max_body_bytes = http.max_body_bytes
        self.in_flight: set[InFlight] = set()
        self.draining = False
        ready = client.client.ready
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = list(ready.eos_token_ids)
        cfg = client.config
        self.mode, self.k = cfg.spec.mode, (cfg.spec.k if cfg.spec.mode != "ar" else 0)
        self.metrics = metrics or ServerMetrics(served_model_name, self.k, prefix=metrics_prefix,
                                                max_model_len=self.max_model_len)
        self.generation_defaults = dict(generation_defaults or {})
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

        async def read() -> None:
            async for part in request.stream():
                buf.extend(part)
                if len(buf) > limit:
                    raise too_big

        try:
            await asyncio.wait_for(read(), self.http.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.http.body_timeout_s} s",
                           code="request_timeout") from None
        try:
            body = json.loads(buf)
        except RecursionError:
            raise APIError(400, "the request body nests too deeply to parse") from None
        except ValueError:  # UnicodeDecodeError included
            raise APIError(400, "the request body is not valid JSON") from None
        check_json_body(body, self.http.max_json_depth)
        return body

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
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        body = await self.read_json(request)
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
        req = apply_generation_defaults(req, self.generation_defaults)
        self.check_model(req.model)
        tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls) if chat else None
        parser = self._tool_parser(tools)
        structured = constraint_of(req, tools)
        # Tool-call markers may be special tokens: keep them in the text the parser reads.
        skip_special = False if parser and "skip_special_tokens" not in req.model_fields_set else None
        prompts, echoes = await self._prompts(req, chat, tools)
        # Every prompt is checked before any is submitted.
        sps = [self._sampling(req, ids, structured, skip_special) for ids in prompts]
        rids = ResponseIds(chat, self.model)
        n, num_top, num_prompt_top = req.num_choices, req.num_top_logprobs(), req.num_prompt_logprobs()
        tokenizer = (self._tokenizer("logprobs" if num_top is not None else "prompt_logprobs")
                     if num_top is not None or num_prompt_top is not None else None)
        flights: list[InFlight] = []
        choices: list[Choice] = []
        try:
            for p, (ids, sp) in enumerate(zip(prompts, sps)):
                for j in range(n):  # n samples of a prompt: seeds seed, seed + 1, ... when given
                    sp_j = sp if sp.seed is None or j == 0 else msgspec.structs.replace(sp, seed=sp.seed + j)
                    if j and num_prompt_top is not None and not req.stream:  # a whole response: computed once
                        sp_j = msgspec.structs.replace(sp_j, prompt_logprobs=None)
                    flights.append(InFlight(self, self.client.submit(ids, sp_j), Tracker(self.metrics)))
                    choices.append(Choice(p * n + j, chat, tokenizer, num_top=num_top, echo=echoes[p],
                                          return_token_ids=req.return_token_ids, tools=tools, parser=parser,
                                          prompt_ids=ids if num_prompt_top is not None else None,
                                          echo_logprobs=not chat and bool(req.echo), prompt_top=req.prompt_logprobs,
                                          first_sample=choices[p * n] if j else None))
        except ValueError as e:  # what the client's own checks refuse
            for f in flights:
                f.end()
            raise APIError(400, str(e)) from None
        except RequestFailed as e:  # the runtime refuses work (its target died, or it is closing)
            for f in flights:
                f.end()
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        num_prompt = sum(len(ids) for ids in prompts)

        def end_all() -> None:
            for f in flights:
                f.end()

        def usage() -> dict:
            return self._usage(num_prompt, choices)

        if req.stream:
            return EngineStream(sse_events(flights, choices, rids, usage, req.include_usage), end_all)
        try:
            return await whole_response(request, flights, choices, rids, usage)
        finally:
            end_all()

    def _sampling(self, req, ids: list[int], structured, skip_special: bool | None):
        """The sampling parameters of one prompt of `req`, its token ids checked."""
        self.check_prompt_ids(ids)
        sp = to_sampling(req, len(ids), self.max_model_len, structured=structured, skip_special_tokens=skip_special)
        for name, ids_ in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", list(sp.logit_bias))):
            for t in ids_:
                if not 0 <= t < self.vocab_size:
                    raise APIError(400, f"{name}: token id {t} is outside [0, {self.vocab_size})", param=name)
        return sp

    def _tool_parser(self, tools: ToolRequest | None) -> str | None:
        if tools is None or tools.choice == "none":
            return None
        template = self.chat_template or getattr(self._tokenizer("tools"), "chat_template", None)
        return tool_parser(template, self.chat.tool_call_parser)

    async def _prompts(self, req, chat: bool, tools: ToolRequest | None = None) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt (tokenized off the event loop), and the text `echo`
        puts before each one's output."""
        if chat:
            messages, kwargs = req.chat_messages(), req.template_kwargs()
            if tools is not None and tools.template_tools() is not None:
                kwargs["tools"] = tools.template_tools()
            if self.chat_template is not None:
                kwargs["chat_template"] = self.chat_template
            try:
                ids = await self.client.encode_chat(messages, **kwargs)
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - no chat template, or it refused these messages
                raise APIError(400, f"the chat template failed: {e}", param="messages") from None
            last = messages[-1]
            echo = last["content"] if req.echo and last["role"] == "assistant" else ""
            return [ids], [echo]
        prompts = req.prompts()
        try:
            ids = [await self.client.encode_prompt(p) for p in prompts]
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the request's fault
            raise APIError(400, f"cannot tokenize the prompt: {e}", param="prompt") from None
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
        cached = stats[0].num_cached_tokens if stats else None  # every choice has the same prompt
        return usage_body(num_prompt, sum(len(c.token_ids) for c in choices), spec, cached)

    def keep(self, task: asyncio.Future) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ shutdown

    def drain(self) -> None:
        """Refuse new generation requests (503); the ones in flight go on."""
        self.draining = True

    def stop_open_requests(self) -> None:
        """End every request still in flight: it is aborted in the engine, a stream gets
        an error event and [DONE], a whole response gets 503."""
        self.draining = True
        if self.in_flight:
            logger.warning("shutdown: ending %d request(s) still in flight", len(self.in_flight))
        err = RequestFailed("server_shutdown: the server is shutting down and ended this request")
        for flight in list(self.in_flight):
            flight.areq.abort()
            flight.tracker.close("abort")
            flight.areq.fail(err)

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
            return await self.client.engine_stats(timeout_s)
        except RequestFailed as e:
            logger.warning("no engine stats: %s", e)
            return None


def engine_stats_dict(st: EngineStats) -> dict:
    # The Structs are array_like (positional on the wire); name the fields for JSON.
    d = msgspec.structs.asdict(st)
    d["totals"] = msgspec.structs.asdict(st.totals)
    return d


def model_name_of(cfg, served_model_name: str | None = None) -> str:
    """The name clients send in `model`: --served-model-name, else the target path."""
    return served_model_name or cfg.target.path or "SmolLM2-135M-Instruct"


def build_app(client: AsyncClient, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int | None = None, http: HTTPConfig | None = None,
              metrics: ServerMetrics | None = None, metrics_prefix: str = "spec_runtime",
              generation_defaults: dict | None = None, chat: ChatConfig | None = None) -> FastAPI:
    """The FastAPI app over a started AsyncClient (the caller owns and closes the client).
    `http` holds the limits; max_body_bytes, if given, overrides its max_body_bytes.
    metrics: the ServerMetrics to record into (default: a fresh one, named after the model,
    its names under `metrics_prefix`: "spec_runtime" or "vllm"). generation_defaults:
    sampling defaults of every request (server.generation_config). chat: the chat
    template override and the tool-call parser."""
    http = http or HTTPConfig()
    if max_body_bytes is not None:
        http = dataclasses.replace(http, max_body_bytes=max_body_bytes)
    name = model_name_of(client.config, served_model_name)
    srv = _Server(client, name, api_key, http, metrics, metrics_prefix, generation_defaults, chat)
    app = FastAPI(title="spec-runtime", docs_url=None, redoc_url=None)
    app.state.server = srv
    app.add_middleware(GuardMiddleware, cfg=http)
    _add_error_handlers(app)
    _add_generation_routes(app, srv)
    add_info_routes(app, srv)
    _add_status_routes(app, srv)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON body."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        # After 408 or 413 the rest of the body is still on its way: close rather than read it.
        headers = {"connection": "close"} if e.status in (408, 413) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException):
        err = APIError(e.status_code, str(e.detail), code=None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError):
        return JSONResponse(APIError(422, str(e.errors()[:1])).body(), status_code=422)


def _add_generation_routes(app: FastAPI, srv: _Server) -> None:
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


def _add_status_routes(app: FastAPI, srv: _Server) -> None:
    """/v1/engine_stats, /health and /metrics."""
    client = srv.client

    @app.get("/v1/engine_stats")
    async def engine_stats(request: Request):
        srv.check_auth(request)
        st = await srv.engine_stats()
        if st is None:
            raise APIError(503, "the engine did not answer", type="server_error")
        return engine_stats_dict(st)

    @app.get("/health")
    async def health():
        status = client.health()
        if status == "dead":
            return JSONResponse({"status": "dead", "reason": client.client.dead_reason}, status_code=503)
        if status == "degraded":
            return {"status": "degraded", "reason": "the draft process is away; serving without speculation"}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        restarts = getattr(srv.client.client.launcher, "num_draft_restarts", 0)
        return Response(srv.metrics.render(await srv.engine_stats(), restarts), media_type=CONTENT_TYPE)
