"""AsyncClient: the in-process runtime (a `Client`) bridged to asyncio.

The Client's I/O thread routes each request's outputs to a sink; here the sink hands
them to the event loop with `call_soon_threadsafe`, so any number of requests stream
concurrently without a thread (or an executor slot) per request. The HTTP server and
user code share this class.

    async with AsyncClient(config) as client:
        res = await client.generate("Hello", max_tokens=32)
        async for out in client.stream("Hello", max_tokens=32): ...
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from protocol.messages import EngineStats, RequestOutput, SamplingParams
from spec_runtime.client import Client
from spec_runtime.results import GenerationResult, RequestFailed
from spec_runtime.config import RuntimeConfig

logger = logging.getLogger(__name__)


class _LoopSink:
    """Receives a request's outputs on the Client's I/O thread; wakes the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class AsyncRequest:
    """One submitted request: iterate it for RequestOutput chunks; `abort()` to stop it."""

    def __init__(self, client: Client, request_id: str, sink: _LoopSink):
        self._client, self.request_id, self._sink = client, request_id, sink
        self.finished = False
        self.final: RequestOutput | None = None

    def __aiter__(self) -> "AsyncRequest":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            self.final = item
        return item

    def abort(self) -> None:
        """Ask the target to stop (it frees the slot and the draft's state, then sends a final output)."""
        if not self.finished:
            self._client.abort(self.request_id)

    def fail(self, err: Exception) -> None:
        """End the iteration with `err` after the outputs already queued (call on the loop's thread)."""
        if not self.finished:
            self._sink.queue.put_nowait(err)

    async def drain(self, timeout_s: float = 30.0) -> RequestOutput | None:
        """Consume what is left (after `abort`) and return the final output, or None."""
        async def rest() -> None:
            async for _ in self:
                pass

        try:
            await asyncio.wait_for(rest(), timeout_s)
        except (asyncio.TimeoutError, RequestFailed) as e:
            logger.warning("request %s did not finish cleanly after abort: %s", self.request_id, e)
        return self.final


class AsyncClient:
    """asyncio API of the runtime: generate, stream, chat, generate_batch, engine_stats."""

    def __init__(self, config: RuntimeConfig | None = None, *, client: Client | None = None, tokenizer=None):
        # Starting the runtime blocks (model load); use `await AsyncClient.start(cfg)` inside a loop.
        self._owns = client is None
        self.client = client if client is not None else Client(config, tokenizer=tokenizer)
        # A fast (Rust) tokenizer refuses concurrent use from several threads ("Already
        # borrowed"): tokenizing runs off the event loop, one call at a time.
        self._tokenizer_lock = threading.Lock()

    def _locked(self, fn, *args, **kwargs):
        with self._tokenizer_lock:
            return fn(*args, **kwargs)

    @classmethod
    async def start(cls, config: RuntimeConfig | None = None, **kw) -> "AsyncClient":
        return cls(client=await asyncio.to_thread(Client, config, **kw))

    @staticmethod
    def connect(base_url: str, *, api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0):
        """An async client of a running `spec-runtime serve` with the same methods."""
        from spec_runtime.server.http_client import AsyncHTTPClient

        return AsyncHTTPClient(base_url, api_key=api_key, model=model, timeout_s=timeout_s)

    @property
    def config(self) -> RuntimeConfig:
        return self.client.config

    @property
    def tokenizer(self):
        return self.client.tokenizer

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams) -> AsyncRequest:
        sink = _LoopSink(asyncio.get_running_loop())
        rid = self.client.submit(prompt_token_ids, sampling, sink=sink)
        return AsyncRequest(self.client, rid, sink)

    async def stream(self, prompt: str | list[int], sampling: SamplingParams | None = None, *, chat: bool = False,
                     **kw) -> AsyncIterator[RequestOutput]:
        req = self.submit(await self.encode_prompt(prompt, chat), sampling or SamplingParams(**kw))
        try:
            async for out in req:
                yield out
        finally:
            req.abort()  # no-op once finished; a consumer that stops early frees the slot

    async def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                       chat: bool = False, **kw) -> GenerationResult:
        req = self.submit(await self.encode_prompt(prompt, chat), sampling or SamplingParams(**kw))
        return await _collect(req)

    async def generate_batch(self, prompts: list[str | list[int]], sampling: SamplingParams | None = None, *,
                             chat: bool = False, **kw) -> list[GenerationResult]:
        sp = sampling or SamplingParams(**kw)
        reqs = [self.submit(await self.encode_prompt(p, chat), sp) for p in prompts]
        return list(await asyncio.gather(*(_collect(r) for r in reqs)))

    async def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        req = self.submit(await self.encode_chat(messages), sampling or SamplingParams(**kw))
        return await _collect(req)

    async def engine_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """The target's EngineStats; RequestFailed if it does not answer within timeout_s.
        Waits on the event loop (no thread), so many callers never exhaust a pool."""
        sink = _LoopSink(asyncio.get_running_loop())
        self.client.request_stats(sink)
        try:
            item = await asyncio.wait_for(sink.queue.get(), timeout_s)
        except asyncio.TimeoutError:
            raise RequestFailed(f"no stats from the target within {timeout_s} s") from None
        if isinstance(item, Exception):
            raise item
        return item

    def health(self) -> str:
        """"ok", "degraded" (draft away, serving without speculation) or "dead"."""
        return self.client.health()

    async def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Client.encode_prompt off the event loop (tokenizing a long prompt takes a while)."""
        if not isinstance(prompt, str):
            return self.client.encode_prompt(prompt, chat)
        return await asyncio.to_thread(self._locked, self.client.encode_prompt, prompt, chat)

    async def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Client.encode_chat off the event loop."""
        return await asyncio.to_thread(self._locked, self.client.encode_chat, messages, **template_kwargs)

    async def aclose(self) -> None:
        if self._owns:
            await asyncio.to_thread(self.client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def _collect(req: AsyncRequest) -> GenerationResult:
    ids: list[int] = []
    text: list[str] = []
    logprobs: list[float] = []
    prompt = None
    try:
        async for out in req:
            ids.extend(out.new_token_ids)
            text.append(out.text_delta)
            logprobs.extend(out.logprobs)
            prompt = prompt or out.prompt_logprobs
    except asyncio.CancelledError:
        req.abort()
        raise
    final = req.final
    if final is None or final.stats is None:
        raise RequestFailed(f"{req.request_id} ended without a final output")
    return GenerationResult("".join(text), ids, final.finish_reason, final.stats, logprobs, prompt)
