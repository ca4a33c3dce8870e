"""How a generation request's outputs reach the HTTP client: one JSON body when the
whole response is wanted, server-sent events when it streams.

Either way every choice's outputs feed its metrics tracker, a RequestFailed becomes
OpenAI's error body (an event in a stream), and a client that goes away ends the
requests (the caller's end_all aborts them in the engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from spec_runtime.results import RequestFailed
from spec_runtime.server.async_client import AsyncRequest
from spec_runtime.server.flight import InFlight
from spec_runtime.server.openai_protocol import APIError
from spec_runtime.server.openai_responses import Choice, ResponseIds

logger = logging.getLogger(__name__)


async def consume(flight: InFlight, choice: Choice) -> None:
    try:
        async for out in flight.areq:
            flight.tracker.on_output(out)
            choice.add(out)
    except RequestFailed:
        flight.tracker.close("error")
        raise

async def whole_response(request: Request, flights: list[InFlight], choices: list[Choice], rids: ResponseIds,
                         usage: Callable[[], dict]) -> Response:
    """Wait for every choice, then one JSON body; 499 when the client went away first."""
    work = asyncio.ensure_future(asyncio.gather(*(consume(f, c) for f, c in zip(flights, choices))))
    gone = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished = work.done()
        if not finished:
            work.cancel()  # the caller's end_all() aborts the requests and counts them
    if not finished:
        logger.info("client went away; aborting %s", ", ".join(f.areq.request_id for f in flights))
        return Response(status_code=499)
    try:
        work.result()
    except RequestFailed as e:  # the caller's end_all() aborts and counts the other choices
        raise engine_error(e) from None
    body = rids.head(chunk=False)
    body["choices"] = [c.whole() for c in choices]
    if choices[0].chat and choices[0].prompt_top is not None:  # vLLM: chat's are the response's
        body["prompt_logprobs"] = choices[0].vllm_prompt_logprobs()
    body["usage"] = usage()
    return JSONResponse(body)

async def sse_events(flights: list[InFlight], choices: list[Choice], rids: ResponseIds, usage: Callable[[], dict],
                     include_usage: bool):
    """The SSE events of a stream: a chunk per output, errors as an event, then [DONE]."""
    areqs = [f.areq for f in flights]
    try:
        async for i, out in merged(areqs):
            flights[i].tracker.on_output(out)
            if not (out.new_token_ids or out.text_delta or out.finished):
                continue
            chunk = rids.head(chunk=True)
            chunk["choices"] = [choices[i].add(out)]
            if include_usage:
                chunk["usage"] = None
            yield event(chunk)
        if include_usage:
            chunk = rids.head(chunk=True)
            chunk["choices"] = []
            chunk["usage"] = usage()
            yield event(chunk)
    except RequestFailed as e:
        for f in flights:
            if f.areq.finished:
                f.tracker.close("error")
        yield event(engine_error(e).body())
    except Exception:  # noqa: BLE001 - the stream still ends as a stream
        logger.exception("stream of %s failed", ", ".join(a.request_id for a in areqs))
        for f in flights:
            if f.areq.finished:
                f.tracker.close("error")
        yield event(APIError(500, "internal server error", type="server_error", code="internal_error").body())
    finally:
        for f in flights:
            f.end()  # the client disconnected (the response task was cancelled), or a choice failed: abort
    yield "data: [DONE]\n\n"


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def merged(areqs: list[AsyncRequest]):
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


async def wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or nothing).
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def engine_error(e: RequestFailed) -> APIError:
    msg = str(e)
    if msg.startswith("bad_request"):
        return APIError(400, msg)
    if msg.startswith("server_shutdown"):
        return APIError(503, msg, type="server_error", code="server_shutting_down")
    return APIError(500, msg, type="server_error", code="internal_error")
