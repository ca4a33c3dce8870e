"""HTTP limits of `spec-runtime serve`, and the two pieces that enforce them.

  - `HTTPConfig`: body, header and time limits, and the shutdown drain, in one frozen
    dataclass (the serve command's flags are made from its fields).
  - `limited_h11_protocol(cfg)`: uvicorn's h11 protocol with a header deadline (a
    connection that has not sent a whole request head within `header_timeout_s` is
    closed, whether it is new or idle after a response; uvicorn's own keep-alive timer
    restarts on every byte, so a client trickling a byte a second would hold a
    connection for ever) and OpenAI's JSON error body on the requests h11 refuses
    (431 for a header block over `max_header_bytes`, else 400) instead of plain text.
  - `GuardMiddleware`: 431 for more than `max_headers` headers or a head over
    `max_header_bytes` that h11 took in one piece, and a JSON 500 for any
    exception a route leaks, answered on the connection it came on, which stays usable.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class HTTPConfig:
    """Limits of the HTTP front end; every one is a flag of `spec-runtime serve`."""

    max_body_bytes: int = _f(1 << 20, "Larger request bodies get 413.")
    max_header_bytes: int = _f(32 << 10, "Larger request heads (request line and headers) get 431.")
    max_headers: int = _f(100, "Requests with more headers get 431.")
    max_json_depth: int = _f(64, "Request bodies nested deeper (arrays and objects) get 400.")
    header_timeout_s: float = _f(10.0, "Seconds a connection may take to send a whole request head, from "
                                       "connect or from the end of the previous response; then it is closed.")
    body_timeout_s: float = _f(30.0, "Seconds a client may take to send a request body; then it gets 408.")
    keep_alive_timeout_s: float = _f(5.0, "Seconds an idle keep-alive connection stays open.")
    shutdown_timeout_s: float = _f(30.0, "On SIGTERM/SIGINT: seconds in-flight requests may take to finish; "
                                         "streams still open then end with an error event and [DONE].")

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "max_headers", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


def error_body(message: str, code: str | None = None, type: str = "invalid_request_error") -> bytes:
    """OpenAI's error body, encoded."""
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


# ---------------------------------------------------------------- protocol


def limited_h11_protocol(cfg: HTTPConfig) -> type[H11Protocol]:
    """uvicorn's H11Protocol with the header deadline and JSON protocol errors of `cfg`."""

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_deadline = None
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(cfg.header_timeout_s, self._on_head_deadline)

        def _on_head_deadline(self) -> None:
            self._head_deadline = None
            # Still no complete request head, and no response under way: a slow client.
            waiting_for_head = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
            if waiting_for_head and not self.transport.is_closing():
                logger.info("closing a connection that sent no request head within %.1f s", cfg.header_timeout_s)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            if getattr(self, "_head_deadline", None) is not None:
                self._head_deadline.cancel()
                self._head_deadline = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # uvicorn calls this from the `except h11.RemoteProtocolError` of handle_events;
            # the error's status hint tells a head that is too large (431) from garbage (400).
            exc = sys.exc_info()[1]
            status = getattr(exc, "error_status_hint", 400) if isinstance(exc, h11.RemoteProtocolError) else 400
            if status == 431:
                body = error_body(f"the request head is over the {cfg.max_header_bytes}-byte limit",
                                  "request_header_fields_too_large")
            else:
                status = 400
                body = error_body(f"invalid HTTP request: {exc or msg}", "invalid_http_request")
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass  # h11 cannot answer in this state; closing is all that is left
            self.transport.close()

    return LimitedH11Protocol


# ---------------------------------------------------------------- ASGI middleware


class GuardMiddleware:
    """Outermost ASGI layer: header-count limit, and JSON for any exception a route leaks."""

    def __init__(self, app, cfg: HTTPConfig):
        self.app = app
        self.cfg = cfg

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if len(headers) > self.cfg.max_headers:
            await _send_json(send, 431, error_body(f"more than {self.cfg.max_headers} request headers",
                                                   "request_header_fields_too_large"), close=True)
            return
        # h11 bounds a head that arrives in pieces; one that arrives whole is measured here.
        head_bytes = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + 16 + sum(
            len(k) + len(v) + 4 for k, v in headers)
        if head_bytes > self.cfg.max_header_bytes:
            await _send_json(send, 431, error_body(f"the request head is over the {self.cfg.max_header_bytes}-byte "
                                                   "limit", "request_header_fields_too_large"), close=True)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - the client gets an answer; the log gets the traceback
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response is out: only closing the connection is left
            await _send_json(send, 500, error_body("internal server error", "internal_error", "server_error"))


async def _send_json(send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
