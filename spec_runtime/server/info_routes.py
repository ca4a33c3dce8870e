"""vLLM's utility endpoints, with vLLM's request and response shapes:

    GET  /v1/models/{model}   one model card (OpenAI's "retrieve model"); 404 for another name
    POST /tokenize            {"prompt": str, "add_special_tokens": true} or {"messages": [...], chat options}
                              -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize          {"tokens": [int]} -> {"prompt": str}
    GET  /version             {"version": spec-runtime's version}
    GET|POST /ping            200 while the engine can serve, 503 when it is dead (as /health)

As in vLLM, /tokenize, /detokenize, /version and /ping sit outside /v1 and need no API key.
Bodies go through the same checks as generation requests (size, UTF-8, nesting), and
tokenization runs off the event loop.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from spec_runtime.inputs import check_text
from spec_runtime.server.openai_protocol import APIError, ChatMessage, _Strict


class TokenizeCompletion(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class Detokenize(_Strict):
    model: str | None = None
    tokens: list[int]


def _parse(cls, body):
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported parameter {param!r}", param=param, code="unsupported_parameter") from None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None


def runtime_version() -> str:
    try:
        return version("spec-runtime")
    except PackageNotFoundError:
        return "unknown"


def add_info_routes(app: FastAPI, srv) -> None:
    """Register the routes above on `app`, over the _Server `srv`."""

    def tokenizer(param: str):
        return srv._tokenizer(param)

    async def in_thread(fn, *args, **kwargs):
        return await asyncio.to_thread(srv.client._locked, fn, *args, **kwargs)

    def check_model(name: str | None) -> None:
        if name is not None:
            srv.check_model(name)

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request):
        srv.check_auth(request)
        if model_id != srv.model:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves `{srv.model}`.",
                           param="model", code="model_not_found")
        return srv.models()["data"][0]

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await srv.read_json(request)
        chat = isinstance(body, dict) and "messages" in body
        req = _parse(TokenizeChat if chat else TokenizeCompletion, body)
        check_model(req.model)
        tok = tokenizer("messages" if chat else "prompt")
        try:
            if chat:
                ids = await _encode_chat(srv, req)
            else:
                ids = list(await in_thread(_encode, tok, req.prompt, req.add_special_tokens))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - what the tokenizer or template refuses is the request's fault
            raise APIError(400, f"cannot tokenize: {e}", param="messages" if chat else "prompt") from None
        strs = await in_thread(tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _parse(Detokenize, await srv.read_json(request))
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < srv.vocab_size]
        if bad:
            raise APIError(400, f"tokens must be in [0, {srv.vocab_size}), got {bad[0]}", param="tokens")
        tok = tokenizer("tokens")
        return {"prompt": await in_thread(tok.decode, req.tokens)}

    @app.get("/version")
    async def get_version():
        return {"version": runtime_version()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        if srv.client.health() == "dead":
            return JSONResponse({"status": "dead", "reason": srv.client.client.dead_reason}, status_code=503)
        return Response(status_code=200)


async def _encode_chat(srv, req: TokenizeChat) -> list[int]:
    """/tokenize with messages: the ids the chat template gives, as for a chat request."""
    if not req.messages:
        raise APIError(400, "messages must be non-empty", param="messages")
    if req.add_special_tokens:
        raise APIError(400, "add_special_tokens: true is not supported with messages: the chat template "
                       "places the special tokens, as for a chat request", param="add_special_tokens",
                       code="unsupported_parameter")
    messages = [m.template_dict(f"messages.{i}") for i, m in enumerate(req.messages)]
    kw = dict(req.chat_template_kwargs or {})
    clash = {"messages", "add_generation_prompt", "continue_final_message", "tokenize"} & set(kw)
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs")
    kw.update(add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message)
    return await srv.client.encode_chat(messages, **kw)


def _encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    check_text(text, "the prompt")
    return tok.encode(text, add_special_tokens=add_special_tokens)
