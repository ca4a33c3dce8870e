"""One HTTP request run through an ASGI app inside this process (a Serve replica
answering spec_runtime.ray.router). Plain asyncio: no Ray, no FastAPI."""

from __future__ import annotations

import asyncio


async def call_asgi(app, request: dict):
    """Run one HTTP request through an ASGI app in this process; yield (status, headers),
    then each body chunk as the app sends it. The app sees a disconnect when the caller
    stops iterating (Serve cancels this generator when the router's client goes away)."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await queue.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request["method"],
             "scheme": "http", "path": request["path"], "raw_path": request["path"].encode(),
             "query_string": request["query"], "headers": request["headers"], "client": None, "server": None,
             "root_path": ""}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda t: queue.put_nowait({"type": "_done"}))
    try:
        while True:
            msg = await queue.get()
            if msg["type"] == "http.response.start":
                yield msg["status"], [(k.decode(), v.decode()) for k, v in msg.get("headers", [])]
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    break
            elif msg["type"] == "_done":
                task.result()  # raises what the app raised
                break
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=5.0)
