"""The server's metrics through `ray.util.metrics`, so the cluster's Prometheus sees the
sum over every Serve replica.

Each replica records the same observations into two places: its own prometheus_client
registry (GET /metrics through the Serve proxy, which reaches one replica and says so)
and the metrics below, which Ray's metrics agent on each node exports for Prometheus to
scrape, one series per worker process: sum them (`sum without (WorkerId, ...)`). Names,
help and labels are those of spec_runtime.server.metrics, with Ray's `ray_` prefix and
`_` for `:` (Ray's exporter drops names with a colon): `spec_runtime:request_success_total`
on /metrics is `ray_spec_runtime_request_success_total` in Ray's (with --metrics-prefix
vllm, `vllm:request_success_total` and `ray_vllm_request_success_total`).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from protocol.messages import EngineStats, RequestStats
from spec_runtime.server.metrics import (
    _LATENCY_BUCKETS,
    COUNTERS,
    ENGINE_COUNTERS,
    GAUGES,
    HISTOGRAMS,
    PREFIXES,
    engine_gauges,
    finished_observations,
    length_buckets,
)

class RayMetrics:
    """ray.util.metrics twins of ServerMetrics; fed by it (ServerMetrics(mirror=...)).
    prefix: as ServerMetrics' ("vllm": `vllm:x` on /metrics is `ray_vllm_x` in Ray's)."""

    def __init__(self, model_name: str, k: int, max_model_len: int = 2048, prefix: str = "spec_runtime"):
        P = PREFIXES[prefix].replace(":", "_")
        self._tags = {"model_name": model_name}
        lbl = ("model_name",)
        buckets = {"latency": list(_LATENCY_BUCKETS), "length": list(length_buckets(max_model_len))}
        for attr, name, doc, *extra in COUNTERS:
            setattr(self, attr, Counter(P + name, doc, tag_keys=lbl + tuple(extra)))
        for attr, name, doc, kind in HISTOGRAMS:
            setattr(self, attr, Histogram(P + name, doc, boundaries=buckets[kind], tag_keys=lbl))
        for attr, name, doc in GAUGES:
            setattr(self, attr, Gauge(P + name, doc, tag_keys=lbl))
        for attr, _, name, doc in ENGINE_COUNTERS:
            setattr(self, attr, Counter(P + name, doc, tag_keys=lbl))
        self.round_choice = Gauge(P + "spec_decode_round_choice", "SSD mode: 1 for the round policy's current "
                                  "choice per batch-size bucket, 0 for an earlier one.",
                                  tag_keys=lbl + ("batch_size", "choice"))
        self._extra_keys = {attr: tuple(extra) for attr, _, _, *extra in COUNTERS}
        self._extra_keys.update({attr: () for attr, *_ in ENGINE_COUNTERS})
        self._choices: dict[str, str] = {}  # batch-size bucket -> the choice last set to 1
        self._k = k

    def _inc(self, attr: str, value: float, extra: tuple[str, ...] = ()) -> None:
        if value > 0:  # ray.util.metrics refuses 0
            tags = {**self._tags, **dict(zip(self._extra_keys[attr], extra))}
            getattr(self, attr).inc(value, tags=tags)

    def observe_chunk_gap(self, gap_s: float) -> None:
        self.itl.observe(gap_s, tags=self._tags)

    def observe_finished(self, stats: RequestStats, finish_reason: str | None, ttft_s: float | None,
                         e2e_s: float, num_completion: int) -> None:
        incs, obs = finished_observations(stats, finish_reason, ttft_s, e2e_s, num_completion)
        for attr, value, extra in incs:
            self._inc(attr, value, extra)
        for attr, value in obs:
            getattr(self, attr).observe(value, tags=self._tags)

    def observe_engine(self, engine: EngineStats) -> None:
        for attr, value in engine_gauges(engine):
            getattr(self, attr).set(value, tags=self._tags)

    def inc_counter(self, attr: str, value: float) -> None:
        """A counter the server follows from the engine's totals (preemptions, prefix cache, round policy)."""
        self._inc(attr, value)

    def set_round_choices(self, choices: dict[int, str]) -> None:
        """Ray's gauges keep every label set once written: an earlier choice goes to 0."""
        now = {str(bucket): choice for bucket, choice in choices.items()}
        for bucket, choice in self._choices.items():
            if now.get(bucket) != choice:
                self.round_choice.set(0, tags={**self._tags, "batch_size": bucket, "choice": choice})
        for bucket, choice in now.items():
            self.round_choice.set(1, tags={**self._tags, "batch_size": bucket, "choice": choice})
        self._choices = now

    def observe_draft_restarts(self, num_new: int) -> None:
        self._inc("draft_restarts", num_new)
