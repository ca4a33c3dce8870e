"""Per-request bookkeeping of the HTTP server: metrics, abort on early close, SSE response.

Every submitted request ends in the metrics exactly once: with its final output when one
arrives, else as "abort" (the client left, or shutdown ended it) or "error" (the engine
failed it). `InFlight.end()` is the one place a response hands its request back.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.responses import StreamingResponse

from protocol.messages import RequestOutput, RequestStats
from spec_runtime.server.async_client import AsyncRequest
from spec_runtime.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class Tracker:
    """Latencies and token count of one request, recorded into the metrics at its end."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.token_ids: list[int] = []
        self.recorded = False

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
            self._record(out.stats, out.finish_reason)

    def close(self, reason: str) -> None:
        """End a request that got no final output (aborted, failed, cut at shutdown)."""
        self._record(RequestStats(), reason)

    def _record(self, stats: RequestStats, reason: str | None) -> None:
        if self.recorded:
            return
        self.recorded = True
        ttft = self.first - self.arrival if self.first is not None else None
        self.metrics.observe_finished(stats, reason, ttft, time.monotonic() - self.arrival, len(self.token_ids))


class InFlight:
    """One submitted request and its metrics; `end()` runs once whatever the path."""

    def __init__(self, srv, areq: AsyncRequest, tracker: Tracker):
        self.srv, self.areq, self.tracker = srv, areq, tracker
        srv.in_flight.add(self)

    def end(self) -> None:
        """Called when the response is done or abandoned: a request still running is
        aborted, and its final output (or, failing that, "abort") goes to the metrics."""
        if self not in self.srv.in_flight:
            return
        self.srv.in_flight.discard(self)
        if self.areq.finished:
            self.tracker.close("error")  # no-op when its final output was recorded
            return
        logger.info("response closed early; aborting %s", self.areq.request_id)
        self.areq.abort()
        self.srv.keep(asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        final = await self.areq.drain()
        if final is not None:
            self.tracker.on_output(final)
        self.tracker.close("abort")


class EngineStream(StreamingResponse):
    """An SSE response whose request is ended (aborted, counted) however the response
    ends, even when the client leaves before the body generator first runs."""

    def __init__(self, gen, on_close):
        super().__init__(gen, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
