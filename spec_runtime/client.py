"""Python client of the runtime: `generate`, `stream`, `chat`, `generate_batch`.

`Client(config)` starts target_proc (and draft_proc) in the background and talks to the
target over the client link (a DEALER socket; the target's end is a ROUTER). One I/O
thread owns the socket: it sends what callers queue and routes each TokenOutputs entry
to the queue of its request, so any number of threads may generate at once.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Iterator

import numpy as np
import zmq

from protocol.codec import ProtocolError, encode
from protocol.messages import (
    AbortRequest,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    StatsRequest,
    TargetToClientMessage,
    TokenOutputs,
)
from protocol.transport import Channel, set_curve_client
from spec_runtime.config import RuntimeConfig
from spec_runtime.inputs import as_token_ids, check_text
from spec_runtime.launcher import Launcher
from spec_runtime.results import GenerationResult, RequestFailed
from spec_runtime.validate import RequestError, validate_sampling

logger = logging.getLogger(__name__)


_DONE = object()


class Client:
    def __init__(self, config: RuntimeConfig | None = None, *, tokenizer=None, launcher=None):
        """launcher: an already started runtime (e.g. spec_runtime.ray's RayDeployment) with
        the Launcher's `client_addr`, `ready`, `dead_child()`, `pids()`, `shutdown()`; the
        client owns it from here (close() shuts it down). None: start a local Launcher.
        tokenizer: the target's, or a Future of it (loaded while the processes start), or
        None to load it on first use."""
        self.config = config or RuntimeConfig()
        self.launcher = launcher if launcher is not None else Launcher(self.config)
        self.ready = self.launcher.ready["target"]
        self._tokenizer = tokenizer
        self._ids = itertools.count()
        self._queues: dict[str, queue.Queue] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._stats_waiters: list[queue.Queue] = []
        self._sinks: set[str] = set()  # request ids whose outputs go to a caller's sink
        self._lock = threading.Lock()
        self._closed = False
        self._dead_reason: str | None = None  # set once the I/O thread cannot go on
        self._chan = Channel(zmq.DEALER, TargetToClientMessage)
        server_key = getattr(self.launcher, "client_curve_server_key", None)
        if server_key is not None:  # a tcp client link (Ray across nodes) is CURVE-encrypted
            set_curve_client(self._chan.socket, server_key)
        self._chan.connect(self.launcher.client_addr)
        self._io = threading.Thread(target=self._io_main, name="client-io", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ public API

    @staticmethod
    def connect(base_url: str, *, api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0):
        """A client of a running `spec-runtime serve` (same generate/stream/chat/generate_batch)."""
        from spec_runtime.server.http_client import HTTPClient

        return HTTPClient(base_url, api_key=api_key, model=model, timeout_s=timeout_s)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from spec_runtime.models.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.target.path, self.config.target.gguf_cache)
        elif isinstance(self._tokenizer, Future):
            self._tokenizer = self._tokenizer.result()
        return self._tokenizer

    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt; ValueError for text that is not valid UTF-8 or ids that are not ints."""
        if not isinstance(prompt, str):
            return as_token_ids(prompt)
        check_text(prompt, "the prompt")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return list(self.tokenizer.encode(prompt))

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """The chat template's tokens for `messages`; template_kwargs reach the template
        (add_generation_prompt, default True; continue_final_message; tools; chat_template,
        which replaces the model's own; e.g. enable_thinking)."""
        tok = self.tokenizer
        if not template_kwargs.get("chat_template") and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be a dict with role and content")
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"messages[{i}].{key}")
        template_kwargs.setdefault("add_generation_prompt", True)
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, **template_kwargs)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages is bad input
            raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def health(self) -> str:
        """"ok"; "degraded" while the draft is away (requests are served without
        speculation); "dead" once the target or this client's I/O thread is gone."""
        if self._dead_reason is not None or self.launcher.dead_child() == "target":
            return "dead"
        if self.launcher.dead_child() == "draft":
            return "degraded"
        return "ok"

    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is not None:
            return self._dead_reason
        if self.launcher.dead_child() == "target":
            return "the target process died; the runtime cannot serve requests"
        return None

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *, sink=None) -> str:
        """Queue one request. With `sink` (any object with `put(item)`), its outputs and errors go
        to sink.put from the I/O thread instead of to the queue `stream_outputs` reads, and the
        client forgets the request after its final output or an error (AsyncClient uses this
        to wake an event loop without a thread per request)."""
        request_id = f"req-{next(self._ids)}"
        frames = self._encode_request(request_id, prompt_token_ids, sampling)  # ValueError for bad input
        q = sink if sink is not None else queue.Queue()
        with self._lock:
            if self._closed:
                raise RequestFailed("the client is closed")
            reason = self.dead_reason
            if reason is not None:
                raise RequestFailed(reason)
            self._queues[request_id] = q
            if sink is not None:
                self._sinks.add(request_id)
        self._outbox.put((request_id, frames))
        return request_id

    @staticmethod
    def _encode_request(request_id: str, prompt_token_ids, sampling: SamplingParams) -> list:
        """Check and encode a GenerateRequest here, in the caller's thread."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        ids = np.asarray(as_token_ids(prompt_token_ids), dtype=np.int64)
        try:
            validate_sampling(sampling)
        except RequestError as e:
            raise ValueError(str(e)) from None
        for s in sampling.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got {type(s).__name__}")
            check_text(s, "a stop string")
        try:
            return encode(GenerateRequest(request_id, ids, sampling))
        except ProtocolError as e:
            raise ValueError(f"the request cannot be sent: {e}") from None

    def abort(self, request_id: str) -> None:
        self._outbox.put((None, encode(AbortRequest(request_id))))

    def stream_outputs(self, request_id: str, timeout_s: float | None = None) -> Iterator[RequestOutput]:
        """RequestOutput chunks of one request as the target accepts them."""
        q = self._queues[request_id]
        try:
            while True:
                item = q.get(timeout=timeout_s)
                if item is _DONE:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        except queue.Empty:
            raise RequestFailed(f"no output for {request_id} within {timeout_s} s") from None
        finally:
            with self._lock:
                self._queues.pop(request_id, None)

    def stream(self, prompt: str | list[int], sampling: SamplingParams | None = None, *, chat: bool = False,
               **kw) -> Iterator[RequestOutput]:
        sp = sampling or SamplingParams(**kw)
        return self.stream_outputs(self.submit(self.encode_prompt(prompt, chat), sp))

    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, *, chat: bool = False,
                 **kw) -> GenerationResult:
        return self.generate_batch([prompt], sampling, chat=chat, **kw)[0]

    def generate_batch(self, prompts: list[str | list[int]], sampling: SamplingParams | None = None, *,
                       chat: bool = False, **kw) -> list[GenerationResult]:
        """Submit all prompts at once (they are batched together) and wait for all."""
        sp = sampling or SamplingParams(**kw)
        ids = [self.submit(self.encode_prompt(p, chat), sp) for p in prompts]
        return [self._collect(rid) for rid in ids]

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        sp = sampling or SamplingParams(**kw)
        return self._collect(self.submit(self.encode_chat(messages), sp))

    def engine_stats(self, timeout_s: float = 5.0) -> EngineStats:
        q: queue.Queue = queue.Queue()
        self.request_stats(q)
        try:
            item = q.get(timeout=timeout_s)
        except queue.Empty:
            raise RequestFailed("no stats from the target") from None
        if isinstance(item, Exception):
            raise item
        return item

    def request_stats(self, sink) -> None:
        """Ask the target for EngineStats; they (or a RequestFailed) go to sink.put."""
        reason = self.dead_reason
        if reason is not None:
            sink.put(RequestFailed(reason))
            return
        with self._lock:
            self._stats_waiters.append(sink)
        self._outbox.put((None, encode(StatsRequest())))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io.join(timeout=2.0)
        self._chan.close()
        self.launcher.shutdown()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _collect(self, request_id: str) -> GenerationResult:
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[float] = []
        last = prompt = None
        for out in self.stream_outputs(request_id):
            ids.extend(out.new_token_ids)
            text.append(out.text_delta)
            logprobs.extend(out.logprobs)
            prompt = prompt or out.prompt_logprobs
            last = out
        if last is None or last.stats is None:
            raise RequestFailed(f"{request_id} ended without a final output")
        return GenerationResult("".join(text), ids, last.finish_reason, last.stats, logprobs, prompt)

    def _io_main(self) -> None:
        try:
            self._io_loop()
        except BaseException as e:  # noqa: BLE001 - whatever stops the loop, nobody may wait forever
            if self._closed:
                return
            logger.exception("the client I/O thread stopped")
            self._mark_dead(f"the client I/O thread stopped: {type(e).__name__}: {e}")

    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            self._dead_reason = reason
        self._fail_all(RequestFailed(reason))

    def _io_loop(self) -> None:
        pending = None  # (request_id, frames) that the socket would not take yet
        while not self._closed:
            while True:
                if pending is None:
                    try:
                        pending = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                if not self._send(*pending):
                    break  # the target is not reading; keep it for the next pass
                pending = None
            if self.launcher.dead_child() == "target":
                self._fail_all(RequestFailed("the target process died; the runtime cannot serve requests"))
            try:
                msg = self._chan.recv(timeout_s=0.002)
            except ProtocolError as e:
                logger.warning("dropping a malformed message from the target: %s", e)
                continue
            if msg is None:
                continue
            try:
                self._route(msg)
            except Exception:  # noqa: BLE001 - one message that cannot be routed must not stop the rest
                logger.exception("could not route a %s from the target; dropped it", type(msg).__name__)

    def _send(self, request_id: str | None, frames: list) -> bool:
        """Send one encoded message; False if the socket's queue is full. A send that fails
        fails its request (if it has one); the loop goes on."""
        try:
            self._chan.socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                raise  # the socket is gone: the loop cannot go on
            self._fail_one(request_id, RequestFailed(f"could not send the request: {e}"))
        except Exception as e:  # noqa: BLE001
            logger.exception("could not send a message to the target")
            self._fail_one(request_id, RequestFailed(f"could not send the request: {type(e).__name__}: {e}"))
        return True

    def _fail_one(self, request_id: str | None, err: Exception) -> None:
        if request_id is None:
            return
        q = self._queues.get(request_id)
        if q is not None:
            q.put(err)
            self._forget_sink(request_id)

    def _route(self, msg) -> None:
        if isinstance(msg, TokenOutputs):
            for out in msg.outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put(out)
                    if out.finished:
                        self._forget_sink(out.request_id)
        elif isinstance(msg, ErrorReply):
            q = self._queues.get(msg.request_id)
            err = RequestFailed(f"{msg.code}: {msg.message}")
            if q is not None:
                q.put(err)
                self._forget_sink(msg.request_id)
            else:
                logger.warning("target error: %s", err)
        elif isinstance(msg, EngineStats):
            with self._lock:
                waiters, self._stats_waiters = self._stats_waiters, []
            for w in waiters:
                w.put(msg)

    def _forget_sink(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._sinks:
                self._sinks.discard(request_id)
                self._queues.pop(request_id, None)

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            queues = list(self._queues.values())
            # A sink hears the error once, not once per I/O loop pass while the target stays dead.
            for rid in self._sinks:
                self._queues.pop(rid, None)
            self._sinks.clear()
            waiters, self._stats_waiters = self._stats_waiters, []
        for q in queues + waiters:
            try:
                q.put(err)
            except Exception:  # noqa: BLE001 - a broken sink must not keep the others from hearing
                logger.exception("could not deliver an error to a request")
        time.sleep(0.05)
