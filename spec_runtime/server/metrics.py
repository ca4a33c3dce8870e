"""Prometheus metrics of the server, through prometheus_client.

Counters count, so each equals the sum over finished requests (aborted ones included)
of the same field in that request's `usage.spec_decode`; prometheus_client exposes a
counter `x` as `x_total`. Names follow vLLM's (`vllm:spec_decode_num_drafts` ...) with
the `spec_runtime:` prefix. Running/waiting gauges are read from the engine at scrape
time. Each app gets its own CollectorRegistry, so several servers can live in one
process (tests).

Latency definitions (server side, from request arrival):
  TTFT  first output chunk;
  ITL   gap between consecutive output chunks; with speculation one chunk carries every
        token a round accepted, so this is a per-round latency, not per token;
  TPOT  (e2e - TTFT) / (completion tokens - 1), one sample per request;
  e2e   final chunk.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from protocol.messages import EngineStats, RequestStats

P = "spec_runtime:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


# The counters both the server's registry and Ray's metrics (spec_runtime.ray.metrics)
# export: (attribute, name, help, extra label keys...).
COUNTERS = (
    ("num_drafts", "spec_decode_num_drafts", "Rounds in which the draft proposed tokens."),
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed."),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("accepted_per_pos", "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position (0-based).",
     "position"),
    ("drafted_per_pos", "spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at each position (0-based).",
     "position"),
    ("cache_hits", "spec_decode_cache_hits", "SSD tree-cache look-ups that hit."),
    ("cache_misses", "spec_decode_cache_misses", "SSD tree-cache look-ups that missed."),
    ("ar_fallback", "spec_decode_ar_fallback_rounds", "Rounds decoded without speculation."),
    ("sd_rounds", "spec_decode_sd_rounds",
     "SSD mode: rounds answered by a chain drafted on request, as the work-ahead policy chose."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests."),
    ("generation_tokens", "generation_tokens", "Generated tokens of finished requests."),
    ("requests", "request_success", "Finished requests by finish reason.", "finished_reason"),
    ("draft_restarts", "draft_restarts", "Draft processes started again after one died."),
)


class ServerMetrics:
    """The server's metrics in their own registry; updated per chunk and per finished request."""

    def __init__(self, model_name: str, k: int, mirror=None, replica_id: str | None = None):
        """mirror: an object with the same observe_* methods (spec_runtime.ray.metrics.RayMetrics)
        fed every observation too. replica_id: this app is one replica of several (Ray Serve);
        /metrics then says so and exports `replica_info{replica_id}`."""
        self.registry = r = CollectorRegistry()
        self._model = model_name
        self._mirror = mirror
        self._replica_id = replica_id
        lbl = ["model_name"]

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(P + name, doc, lbl + list(extra), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, lbl, buckets=_LATENCY_BUCKETS, registry=r)

        for attr, name, doc, *extra in COUNTERS:
            setattr(self, attr, counter(name, doc, *extra))
        self.running = Gauge(P + "num_requests_running", "Requests being decoded.", lbl, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a slot.", lbl, registry=r)
        self.draft_alive = Gauge(P + "draft_alive", "1 while the draft answers, 0 while the target decodes alone.",
                                 lbl, registry=r)
        self._restarts_seen = 0
        self._lock = threading.Lock()  # observe_engine runs on the event loop and on a gauge thread
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between output chunks (one chunk per round).")
        self.tpot = histogram("time_per_output_token_seconds", "(e2e - TTFT) / (tokens - 1) per request.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.draft_restarts.labels(model_name)  # exported as 0 until a restart
        if replica_id is not None:
            Gauge(P + "replica_info", "1: these metrics are of this replica only (Ray Serve); the cluster-wide "
                  "sums are Ray's ray_spec_runtime_* metrics.", lbl + ["replica_id"], registry=r
                  ).labels(model_name, replica_id).set(1)
        # Make every per-position series exist from the start (0 until it counts).
        for i in range(k):
            self.accepted_per_pos.labels(model_name, str(i))
            self.drafted_per_pos.labels(model_name, str(i))

    def observe_chunk_gap(self, gap_s: float) -> None:
        self.itl.labels(self._model).observe(gap_s)
        if self._mirror is not None:
            self._mirror.observe_chunk_gap(gap_s)

    def observe_finished(self, stats: RequestStats, finish_reason: str | None, ttft_s: float | None,
                         e2e_s: float, num_completion: int) -> None:
        m = self._model
        num_drafts = stats.num_drafts
        self.num_drafts.labels(m).inc(num_drafts)
        self.num_draft_tokens.labels(m).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(m).inc(stats.num_accepted_tokens)
        for i, (a, d) in enumerate(zip(stats.accepted_per_position, stats.drafted_per_position)):
            self.accepted_per_pos.labels(m, str(i)).inc(a)
            self.drafted_per_pos.labels(m, str(i)).inc(d)
        self.cache_hits.labels(m).inc(stats.num_cache_hits)
        self.cache_misses.labels(m).inc(stats.num_cache_misses)
        self.ar_fallback.labels(m).inc(stats.num_ar_fallback_rounds)
        self.sd_rounds.labels(m).inc(stats.num_sd_rounds)
        self.prompt_tokens.labels(m).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_completion)
        self.requests.labels(m, finish_reason or "unknown").inc()
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if num_completion > 1:
                self.tpot.labels(m).observe((e2e_s - ttft_s) / (num_completion - 1))
        self.e2e.labels(m).observe(e2e_s)
        if self._mirror is not None:
            self._mirror.observe_finished(stats, finish_reason, ttft_s, e2e_s, num_completion)

    def observe_engine(self, engine: EngineStats | None, draft_restarts: int = 0) -> None:
        """Gauges from the engine, and the launcher's draft restart count (the counter follows it)."""
        with self._lock:
            self._observe_engine(engine, draft_restarts)

    def _observe_engine(self, engine: EngineStats | None, draft_restarts: int) -> None:
        if engine is not None:
            self.running.labels(self._model).set(engine.num_running)
            self.waiting.labels(self._model).set(engine.num_waiting)
            self.draft_alive.labels(self._model).set(1.0 if engine.draft_alive else 0.0)
            if self._mirror is not None:
                self._mirror.observe_engine(engine)
        if draft_restarts > self._restarts_seen:
            if self._mirror is not None:
                self._mirror.observe_draft_restarts(draft_restarts - self._restarts_seen)
            self.draft_restarts.labels(self._model).inc(draft_restarts - self._restarts_seen)
            self._restarts_seen = draft_restarts

    def render(self, engine: EngineStats | None, draft_restarts: int = 0) -> bytes:
        self.observe_engine(engine, draft_restarts)
        text = generate_latest(self.registry)
        if self._replica_id is not None:
            note = (f"# spec-runtime: the metrics of Ray Serve replica {self._replica_id} only; the sums over every "
                    "replica are Ray's ray_spec_runtime_* metrics (docs/ray.md).\n")
            text = note.encode() + text
        return text
