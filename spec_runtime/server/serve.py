"""Run the HTTP server: start the runtime, bind, serve with uvicorn, print the ready line.

The ready line ("spec-runtime: serving MODEL on http://HOST:PORT") goes to stdout once
uvicorn accepts connections, so scripts and tests can wait for it; `--port 0` binds a
free port and the line names it.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from spec_runtime.config import RuntimeConfig

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


def _exit_when_target_dies(client, server, died: threading.Event) -> None:
    while not server.should_exit:
        if client.launcher.dead_child() == "target":
            print("spec-runtime: the target process died; stopping the server (exit code 1)", file=sys.stderr,
                  flush=True)
            died.set()
            server.should_exit = True
            return
        time.sleep(0.2)


def run_server(cfg: RuntimeConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, max_body_bytes: int | None = None,
               log_level: str = "warning", out=None, on_target_death: str = "exit") -> int:
    """Serve until interrupted (SIGINT/SIGTERM); shuts the runtime down on the way out.

    on_target_death: "exit" stops serving and returns 1 once the target process has died
    (so a supervisor can restart the server); "stay" keeps answering, /health with 503.
    Returns the process exit code.
    """
    if on_target_death not in ("exit", "stay"):
        raise ValueError(f"on_target_death must be exit or stay, got {on_target_death!r}")
    from spec_runtime.server.app import DEFAULT_MAX_BODY_BYTES, build_app
    from spec_runtime.server.async_client import AsyncClient

    out = out or sys.stdout
    sock = _bind(host, port)  # bind before the slow model load, so a busy port fails fast
    client = AsyncClient(cfg)
    try:
        app = build_app(client, served_model_name=served_model_name, api_key=api_key,
                        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        name = app.state.server.model
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        line = f"spec-runtime: serving {name} on http://{shown}:{bound_port}"
        threading.Thread(target=_announce_when_started, args=(server, line, out), daemon=True).start()
        if threading.current_thread() is threading.main_thread():
            # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; make
            # SIGTERM's re-raise an exit that runs the `finally` below (stopping the children).
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
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
        client.client.close()
