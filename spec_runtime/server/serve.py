"""Run the HTTP server: start the runtime, bind, serve with uvicorn, print the ready line.

The ready line ("spec-runtime: serving MODEL on http://HOST:PORT") goes to stdout once
uvicorn accepts connections, so scripts and tests can wait for it; `--port 0` binds a
free port and the line names it.

HTTP limits (HTTPConfig) go to uvicorn's h11 protocol, extended by http_limits. On
SIGTERM or SIGINT the server stops accepting, lets in-flight requests finish for up to
`shutdown_timeout_s`, then ends the ones still open (streams get an error event and
[DONE]), stops the runtime and exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time

import asyncio

import uvicorn

from spec_runtime.config import RuntimeConfig
from spec_runtime.server.app_options import AppOptions
from spec_runtime.server.http_limits import HTTPConfig, limited_h11_protocol

logger = logging.getLogger(__name__)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _announce_when_started(server: uvicorn.Server, line: str, out) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    out.write(line + "\n")
    out.flush()


class _DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown, with our deadline: after `drain_s` the app ends the
    requests still open, so each gets a proper ending before its connection closes."""

    def __init__(self, config: uvicorn.Config, app_server, drain_s: float):
        super().__init__(config)
        self.app_server, self.drain_s = app_server, drain_s

    async def shutdown(self, sockets=None) -> None:
        n = len(self.app_server.in_flight)
        if n:
            logger.warning("shutting down: waiting up to %.0f s for %d request(s) in flight", self.drain_s, n)
        self.app_server.drain()
        timer = asyncio.get_running_loop().call_later(self.drain_s, self.app_server.stop_open_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def uvicorn_config(app, http: HTTPConfig, log_level: str) -> uvicorn.Config:
    """uvicorn settings for `http`'s limits (h11, with the header deadline and JSON errors)."""
    return uvicorn.Config(
        app, log_level=log_level, http=limited_h11_protocol(http),
        h11_max_incomplete_event_size=http.max_header_bytes, timeout_keep_alive=http.keep_alive_timeout_s,
        # uvicorn cancels what is left this long after the app ended its open requests.
        timeout_graceful_shutdown=http.shutdown_timeout_s + 5.0,
    )


def _exit_when_target_dies(client, server, died: threading.Event) -> None:
    while not server.should_exit:
        if client.launcher.dead_child() == "target":
            print("spec-runtime: the target process died; stopping the server (exit code 1)", file=sys.stderr,
                  flush=True)
            died.set()
            server.should_exit = True
            return
        time.sleep(0.2)


def run_server(cfg: RuntimeConfig, options: AppOptions | None = None, *, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "warning", out=None, on_target_death: str = "exit") -> int:
    """Serve until interrupted (SIGINT/SIGTERM); shuts the runtime down on the way out.

    options: the app's settings (name, key, HTTP limits, metrics prefix, request
    defaults, chat), as `serve`'s flags make them (default AppOptions()).
    on_target_death: "exit" stops serving and returns 1 once the target process has died
    (so a supervisor can restart the server); "stay" keeps answering, /health with 503.
    Returns the process exit code.
    """
    if on_target_death not in ("exit", "stay"):
        raise ValueError(f"on_target_death must be exit or stay, got {on_target_death!r}")
    from spec_runtime.server.app import build_app
    from spec_runtime.server.async_client import AsyncClient

    options = options or AppOptions()
    http = options.http

    out = out or sys.stdout
    sock = _bind(host, port)  # bind before the slow model load, so a busy port fails fast
    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; make
        # SIGTERM (then, or during the model load) an exit that runs the `finally` below,
        # which stops the children and removes the ipc directory.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    client = None
    try:
        client = AsyncClient(cfg)
        app = build_app(client, **options.app_kwargs(cfg.target.path))
        name = app.state.server.model
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        server = _DrainingServer(uvicorn_config(app, http, log_level), app.state.server, http.shutdown_timeout_s)
        line = f"spec-runtime: serving {name} on http://{shown}:{bound_port}"
        threading.Thread(target=_announce_when_started, args=(server, line, out), daemon=True).start()
        target_died = threading.Event()
        if on_target_death == "exit":
            threading.Thread(target=_exit_when_target_dies, args=(client.client, server, target_died),
                             daemon=True).start()
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            logger.info("interrupted; shutting down")
        return 1 if target_died.is_set() else 0
    finally:
        sock.close()
        if client is not None:
            client.client.close()
