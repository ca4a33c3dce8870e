"""The server's metrics through `ray.util.metrics`, so the cluster's Prometheus sees the
sum over every Serve replica.

Each replica records the same observations into two places: its own prometheus_client
registry (GET /metrics through the Serve proxy, which reaches one replica and says so)
and the metrics below, which Ray's metrics agent on each node exports for Prometheus to
scrape, one series per worker process: sum them (`sum without (WorkerId, ...)`). Names,
help and labels are those of spec_runtime.server.metrics, with Ray's `ray_` prefix and
`_` for `:` (Ray's exporter drops names with a colon): `spec_runtime:request_success_total`
on /metrics is `ray_spec_runtime_request_success_total` in Ray's.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from protocol.messages import EngineStats, RequestStats
from spec_runtime.server.metrics import _LATENCY_BUCKETS, COUNTERS, P as _SERVER_PREFIX

P = _SERVER_PREFIX.replace(":", "_")


class RayMetrics:
    """ray.util.metrics twins of ServerMetrics; fed by it (ServerMetrics(mirror=...))."""

    def __init__(self, model_name: str, k: int):
        self._tags = {"model_name": model_name}
        lbl = ("model_name",)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(P + name, doc, tag_keys=lbl + extra)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, boundaries=list(_LATENCY_BUCKETS), tag_keys=lbl)

        for attr, name, doc, *extra in COUNTERS:
            setattr(self, attr, counter(name, doc, *extra))
        self.running = Gauge(P + "num_requests_running", "Requests being decoded.", tag_keys=lbl)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a slot.", tag_keys=lbl)
        self.draft_alive = Gauge(P + "draft_alive", "1 while the draft answers, 0 while the target decodes alone.",
                                 tag_keys=lbl)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between output chunks (one chunk per round).")
        self.tpot = histogram("time_per_output_token_seconds", "(e2e - TTFT) / (tokens - 1) per request.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self._k = k

    def _inc(self, counter: Counter, value: float, **extra: str) -> None:
        if value > 0:  # ray.util.metrics refuses 0
            counter.inc(value, tags={**self._tags, **extra} if extra else self._tags)

    def observe_chunk_gap(self, gap_s: float) -> None:
        self.itl.observe(gap_s, tags=self._tags)

    def observe_finished(self, stats: RequestStats, finish_reason: str | None, ttft_s: float | None,
                         e2e_s: float, num_completion: int) -> None:
        self._inc(self.num_drafts, stats.num_drafts)
        self._inc(self.num_draft_tokens, stats.num_draft_tokens)
        self._inc(self.num_accepted_tokens, stats.num_accepted_tokens)
        for i, (a, d) in enumerate(zip(stats.accepted_per_position, stats.drafted_per_position)):
            self._inc(self.accepted_per_pos, a, position=str(i))
            self._inc(self.drafted_per_pos, d, position=str(i))
        self._inc(self.cache_hits, stats.num_cache_hits)
        self._inc(self.cache_misses, stats.num_cache_misses)
        self._inc(self.ar_fallback, stats.num_ar_fallback_rounds)
        self._inc(self.sd_rounds, stats.num_sd_rounds)
        self._inc(self.prompt_tokens, stats.num_prompt_tokens)
        self._inc(self.generation_tokens, num_completion)
        self._inc(self.requests, 1, finished_reason=finish_reason or "unknown")
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=self._tags)
            if num_completion > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_completion - 1), tags=self._tags)
        self.e2e.observe(e2e_s, tags=self._tags)

    def observe_engine(self, engine: EngineStats) -> None:
        self.running.set(engine.num_running, tags=self._tags)
        self.waiting.set(engine.num_waiting, tags=self._tags)
        self.draft_alive.set(1.0 if engine.draft_alive else 0.0, tags=self._tags)

    def observe_draft_restarts(self, num_new: int) -> None:
        self._inc(self.draft_restarts, num_new)
