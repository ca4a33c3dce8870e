"""What the target does with its clients' messages: generate requests (validated, then
queued), aborts, and stats requests. A mixin of TargetWorker, which holds the state."""

from __future__ import annotations

import logging

from protocol.codec import ProtocolError
from protocol.messages import AbortRequest, ErrorReply, GenerateRequest, StatsRequest
from spec_runtime.validate import RequestError, validate_request
from target_proc.sequence import IncrementalDetokenizer, Sequence

logger = logging.getLogger(__name__)


class ClientRequests:
    """poll_clients and the handlers of each client message (TargetWorker's state)."""

    def poll_clients(self, block: bool) -> None:
        timeout = 0.05 if block else 0.0
        while True:
            try:
                got = self.clients.recv(timeout_s=timeout)
            except ProtocolError as e:
                logger.warning("rejected a malformed client message: %s", e)
                if e.peer is not None:
                    self.clients.send_error_to(e.peer, e.code, str(e))
                continue
            if got is None:
                return
            timeout = 0.0
            ident, msg = got
            try:
                self.on_client_message(ident, msg)
            except Exception as e:  # noqa: BLE001 - one message that cannot be handled fails alone
                logger.exception("could not handle a %s from a client", type(msg).__name__)
                self.clients.send_error_to(ident, "internal", f"{type(e).__name__}: {e}",
                                           request_id=getattr(msg, "request_id", ""))

    def on_client_message(self, ident: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self.on_generate(ident, msg)
        elif isinstance(msg, AbortRequest):
            self.on_abort(ident, msg.request_id)
        elif isinstance(msg, StatsRequest):
            # The draft's counters are the ones it pushed last: a scrape never waits on it.
            self.clients.send_to(ident, self.engine_stats())

    def on_generate(self, ident: bytes, req: GenerateRequest) -> None:
        key = (ident, req.request_id)
        try:
            if key in self.by_request:
                raise RequestError(f"request_id {req.request_id!r} is already in flight")
            prompt = validate_request(req, self.runner.vocab_size, self.max_model_len)
            self.sched.check_fits(len(prompt), req.sampling.max_tokens)
        except RequestError as e:
            self.clients.send_to(ident, ErrorReply(code="bad_request", message=str(e), request_id=req.request_id))
            return
        sp = req.sampling
        seq = Sequence(
            seq_id=self.next_seq_id,
            request_id=req.request_id,
            client=ident,
            prompt_token_ids=prompt,
            sampling=sp,
            seed=sp.seed if sp.seed is not None else self.rng.getrandbits(62),
        )
        if self.runner.tokenizer is not None:  # random-weight benchmark models have none
            seq.detok = IncrementalDetokenizer(self.runner.tokenizer, prompt, sp.skip_special_tokens)
        if sp.structured is not None:
            try:
                seq.grammar = self.grammars.start(sp.structured)
            except ValueError as e:
                self.clients.send_to(ident, ErrorReply(code="bad_request", message=str(e), request_id=req.request_id))
                return
        seq.stats.num_prompt_tokens = len(prompt)
        seq.stats.accepted_per_position = [0] * self.k
        seq.stats.drafted_per_position = [0] * self.k
        self.next_seq_id += 1
        self.by_request[key] = seq
        self.waiting.append(seq)

    def on_abort(self, ident: bytes, request_id: str) -> None:
        seq = self.by_request.get((ident, request_id))
        if seq is None:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finished = True
        seq.finish_reason = "abort"
        self.finish(seq)
