"""Prometheus metrics of the server, through prometheus_client.

Counters count, so each equals the sum over finished requests (aborted ones included)
of the same field in that request's `usage.spec_decode`; prometheus_client exposes a
counter `x` as `x_total` (its `_created` series are turned off). Names
are vLLM's (`spec_decode_num_drafts`, `time_to_first_token_seconds`, ...) under the
prefix `spec_runtime:`, or `vllm:` with `serve --metrics-prefix vllm`, so that
`vllm bench serve` and vLLM's Grafana dashboards read them unchanged. Names vLLM does
not have (`spec_decode_cache_hits`, `draft_alive`, ...) are this runtime's extensions.
Running/waiting gauges, KV usage, preemptions and the prefix cache's counters are read
from the engine at scrape time. Each app
gets its own CollectorRegistry, so several servers can live in one process (tests).

Every definition lives in the tables COUNTERS, HISTOGRAMS and GAUGES, and every value
a finished request contributes is computed once (`finished_observations`); Ray's
metrics (spec_runtime.ray.metrics) reuse both.

Latency definitions (server side, from request arrival, unless said otherwise):
  TTFT  first output chunk;
  ITL   gap between consecutive output chunks; with speculation one chunk carries every
        token a round accepted, so this is a per-round latency, not per token;
  TPOT  (e2e - TTFT) / (completion tokens - 1), one sample per request;
  e2e   final chunk;
  queue, prefill, decode, inference: measured in target_proc (arrival there -> KV blocks
        -> first token -> last token; inference = prefill + decode).
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import disable_created_metrics

from protocol.messages import EngineStats, RequestStats

disable_created_metrics()

PREFIXES = {"spec_runtime": "spec_runtime:", "vllm": "vllm:"}
P = PREFIXES["spec_runtime"]
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def length_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


# The counters both the server's registry and Ray's metrics (spec_runtime.ray.metrics)
# export: (attribute, name, help, extra label keys...).
COUNTERS = (
    ("num_drafts", "spec_decode_num_drafts", "Rounds in which the draft proposed tokens."),
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed."),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("accepted_per_pos", "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position (0-based).",
     "position"),
    # Not named spec_decode_num_draft_tokens_per_pos: `vllm bench serve` adds every vllm:spec_decode_* counter
    # whose name contains "num_draft_tokens" into its draft-token count.
    ("drafted_per_pos", "spec_decode_draft_tokens_per_pos", "Draft tokens proposed at each position (0-based).",
     "position"),
    ("cache_hits", "spec_decode_cache_hits", "SSD tree-cache look-ups that hit."),
    ("cache_misses", "spec_decode_cache_misses", "SSD tree-cache look-ups that missed."),
    ("ar_fallback", "spec_decode_ar_fallback_rounds", "Rounds decoded without speculation."),
    ("sd_rounds", "spec_decode_sd_rounds",
     "SSD mode: rounds answered by a chain drafted on request, as the round policy chose."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests."),
    ("generation_tokens", "generation_tokens", "Generated tokens of finished requests."),
    ("requests", "request_success", "Finished requests by finish reason.", "finished_reason"),
    ("preemptions", "num_preemptions",
     "Times a running request was preempted: its KV blocks freed to let older requests grow, its KV recomputed "
     "when it runs again."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens whose KV the prefix cache held."),
    ("draft_restarts", "draft_restarts", "Draft processes started again after one died."),
)

# Counters that follow the engine's totals (EngineStats field -> attribute), read at scrape time.
_ENGINE_COUNTERS = {"num_preemptions": "preemptions", "prefix_cache_queries": "prefix_cache_queries",
                    "prefix_cache_hits": "prefix_cache_hits"}

# The round policy's and the draft's counters, also following the engine's totals:
# (attribute, EngineStats field, name, help). The draft's tree counters start again at 0
# when a draft is restarted; the counter then adds the new process's count.
ENGINE_COUNTERS = (
    ("ssd_steps", "num_ssd_rounds", "spec_decode_ssd_steps",
     "SSD mode: steps whose request asked the draft to work ahead (SSD rounds), as the round policy chose."),
    ("sd_steps", "num_sd_rounds", "spec_decode_sd_steps",
     "SSD mode: steps whose request asked for a chain drafted on request (synchronous SD rounds)."),
    ("halves_steps", "num_halves_steps", "spec_decode_halves_steps",
     "SSD mode: steps that ran an SD round over one of two halves of the batch, the draft chaining the other half "
     "meanwhile."),
    ("plain_steps", "num_plain_steps", "spec_decode_plain_steps",
     "Steps the speculation or round policy ran without speculation, as measured faster."),
    ("round_switches", "num_round_switches", "spec_decode_round_policy_switches",
     "SSD mode: changes of the round policy's choice for a batch size (probes not counted)."),
    ("tree_shrinks", "draft_tree_shrinks", "spec_decode_tree_shrinks",
     "SSD: moves of the draft's tree to fewer branches per sequence."),
    ("tree_grows", "draft_tree_grows", "spec_decode_tree_grows",
     "SSD: moves of the draft's tree to more branches per sequence."),
    ("steps_ahead", "num_steps_ahead", "steps_queued_ahead",
     "Plain steps queued on the GPU before the host read the tokens of the step before them (--overlap-schedule)."),
    ("verifies_laid_out", "num_verifies_laid_out", "spec_decode_verifies_laid_out",
     "Speculating steps whose verify forward was laid out in a CUDA graph while the draft answered."),
    ("prefill_chunks", "num_prefill_chunks", "num_prefill_chunks",
     "Chunked prefill: prefill pieces that stopped short of their prompt's end, the rest left for later steps "
     "(--max-num-batched-tokens)."),
)

# (attribute, name, help, buckets: "latency" or "length").
HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds", "Time to first token.", "latency"),
    ("itl", "inter_token_latency_seconds", "Gap between output chunks (one chunk per round).", "latency"),
    ("tpot", "time_per_output_token_seconds", "(e2e - TTFT) / (tokens - 1) per request.", "latency"),
    ("e2e", "e2e_request_latency_seconds", "End-to-end request latency.", "latency"),
    ("queue_time", "request_queue_time_seconds", "Time a request waited in target_proc for KV blocks.", "latency"),
    ("prefill_time", "request_prefill_time_seconds", "From a request's KV blocks to its first token (the prefill).",
     "latency"),
    ("decode_time", "request_decode_time_seconds", "From a request's first token to its last.", "latency"),
    ("inference_time", "request_inference_time_seconds", "Prefill plus decode time of a request.", "latency"),
    ("prompt_len", "request_prompt_tokens", "Prompt tokens per finished request.", "length"),
    ("generation_len", "request_generation_tokens", "Generated tokens per finished request.", "length"),
    ("max_generation_len", "request_max_num_generation_tokens",
     "Most tokens generated by one sequence of a request; each engine request is one sequence (n > 1 sends n), "
     "so this equals request_generation_tokens.", "length"),
)

# (attribute, name, help).
GAUGES = (
    ("running", "num_requests_running", "Requests being decoded."),
    ("waiting", "num_requests_waiting", "Requests waiting for a slot."),
    ("kv_cache_usage", "kv_cache_usage_perc",
     "Fraction of the target's KV cache in use (1 = 100%): KV blocks held by requests over all blocks (cached "
     "blocks no request holds count as free)."),
    ("draft_alive", "draft_alive", "1 while the draft answers, 0 while the target decodes alone."),
)


def finished_observations(stats: RequestStats, finish_reason: str | None, ttft_s: float | None, e2e_s: float,
                          num_completion: int) -> tuple[list[tuple[str, float, tuple[str, ...]]],
                                                        list[tuple[str, float]]]:
    """What one finished request adds: (counter increments as (attribute, value, extra label
    values)), (histogram observations as (attribute, value)). A request that ended without a
    final output (aborted, failed) has empty stats: it counts once in request_success and
    observes no engine-side time or length."""
    incs: list[tuple[str, float, tuple[str, ...]]] = [
        ("num_drafts", stats.num_drafts, ()),
        ("num_draft_tokens", stats.num_draft_tokens, ()),
        ("num_accepted_tokens", stats.num_accepted_tokens, ()),
        ("cache_hits", stats.num_cache_hits, ()),
        ("cache_misses", stats.num_cache_misses, ()),
        ("ar_fallback", stats.num_ar_fallback_rounds, ()),
        ("sd_rounds", stats.num_sd_rounds, ()),
        ("prompt_tokens", stats.num_prompt_tokens, ()),
        ("generation_tokens", num_completion, ()),
        ("requests", 1, (finish_reason or "unknown",)),
    ]
    for i, (a, d) in enumerate(zip(stats.accepted_per_position, stats.drafted_per_position)):
        incs.append(("accepted_per_pos", a, (str(i),)))
        incs.append(("drafted_per_pos", d, (str(i),)))
    obs: list[tuple[str, float]] = []
    if ttft_s is not None:
        obs.append(("ttft", ttft_s))
        if num_completion > 1:
            obs.append(("tpot", (e2e_s - ttft_s) / (num_completion - 1)))
    obs.append(("e2e", e2e_s))
    if stats.ttft_s > 0 and stats.e2e_s > 0:  # the engine's timings of a request that got KV blocks and a token
        obs += [("queue_time", stats.queue_s), ("prefill_time", max(0.0, stats.ttft_s - stats.queue_s)),
                ("decode_time", max(0.0, stats.e2e_s - stats.ttft_s)),
                ("inference_time", max(0.0, stats.e2e_s - stats.queue_s))]
    if stats.num_prompt_tokens > 0:
        obs += [("prompt_len", stats.num_prompt_tokens), ("generation_len", num_completion),
                ("max_generation_len", num_completion)]
    return incs, obs


def engine_gauges(engine: EngineStats) -> list[tuple[str, float]]:
    """(attribute, value) of each gauge read from the engine."""
    blocks = engine.num_kv_blocks
    return [("running", engine.num_running), ("waiting", engine.num_waiting),
            ("kv_cache_usage", 1.0 - engine.num_free_kv_blocks / blocks if blocks else 0.0),
            ("draft_alive", 1.0 if engine.draft_alive else 0.0)]


class ServerMetrics:
    """The server's metrics in their own registry; updated per chunk and per finished request."""

    def __init__(self, model_name: str, k: int, mirror=None, replica_id: str | None = None,
                 prefix: str = "spec_runtime", max_model_len: int = 2048):
        """mirror: an object with the same observe_* methods (spec_runtime.ray.metrics.RayMetrics)
        fed every observation too. replica_id: this app is one replica of several (Ray Serve);
        /metrics then says so and exports `replica_info{replica_id}`. prefix: "spec_runtime"
        or "vllm" (names `vllm:...`). max_model_len: the top of the token-count buckets."""
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {sorted(PREFIXES)}, got {prefix!r}")
        self.registry = r = CollectorRegistry()
        self.prefix = p = PREFIXES[prefix]
        self._model = model_name
        self._mirror = mirror
        self._replica_id = replica_id
        lbl = ["model_name"]
        buckets = {"latency": _LATENCY_BUCKETS, "length": length_buckets(max_model_len)}
        for attr, name, doc, *extra in COUNTERS:
            setattr(self, attr, Counter(p + name, doc, lbl + list(extra), registry=r))
        for attr, name, doc, kind in HISTOGRAMS:
            setattr(self, attr, Histogram(p + name, doc, lbl, buckets=buckets[kind], registry=r))
        for attr, name, doc in GAUGES:
            setattr(self, attr, Gauge(p + name, doc, lbl, registry=r))
        for attr, _, name, doc in ENGINE_COUNTERS:
            setattr(self, attr, Counter(p + name, doc, lbl, registry=r))
        self.round_choice = Gauge(p + "spec_decode_round_choice", "SSD mode: 1 for the round policy's current choice "
                                  "per batch-size bucket (e.g. choice=\"ssd 8 branches, backup jit\", \"sd\", "
                                  "\"plain\").", lbl + ["batch_size", "choice"], registry=r)
        self._policy_seen: dict[str, int] = {}
        self._restarts_seen = 0
        # The engine's own totals the counters below follow (they only grow while it lives).
        self._engine_seen = dict.fromkeys(_ENGINE_COUNTERS.values(), 0)
        self._lock = threading.Lock()  # observe_engine runs on the event loop and on a gauge thread
        # Series that exist from the start (0 until they count), so dashboards find them.
        for attr in ("draft_restarts", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "prompt_tokens", "generation_tokens"):
            getattr(self, attr).labels(model_name)
        for attr, *_ in HISTOGRAMS:
            getattr(self, attr).labels(model_name)
        for attr, *_ in GAUGES:
            getattr(self, attr).labels(model_name)
        for attr, *_ in ENGINE_COUNTERS:
            getattr(self, attr).labels(model_name)
        if replica_id is not None:
            Gauge(p + "replica_info", "1: these metrics are of this replica only (Ray Serve); the cluster-wide "
                  "sums are Ray's ray_spec_runtime_* metrics.", lbl + ["replica_id"], registry=r
                  ).labels(model_name, replica_id).set(1)
        for i in range(k):
            self.accepted_per_pos.labels(model_name, str(i))
            self.drafted_per_pos.labels(model_name, str(i))

    def observe_chunk_gap(self, gap_s: float) -> None:
        self.itl.labels(self._model).observe(gap_s)
        if self._mirror is not None:
            self._mirror.observe_chunk_gap(gap_s)

    def observe_finished(self, stats: RequestStats, finish_reason: str | None, ttft_s: float | None,
                         e2e_s: float, num_completion: int) -> None:
        incs, obs = finished_observations(stats, finish_reason, ttft_s, e2e_s, num_completion)
        for attr, value, extra in incs:
            getattr(self, attr).labels(self._model, *extra).inc(value)
        for attr, value in obs:
            getattr(self, attr).labels(self._model).observe(value)
        if self._mirror is not None:
            self._mirror.observe_finished(stats, finish_reason, ttft_s, e2e_s, num_completion)

    def observe_engine(self, engine: EngineStats | None, draft_restarts: int = 0) -> None:
        """Gauges from the engine, and the launcher's draft restart count (the counter follows it)."""
        with self._lock:
            self._observe_engine(engine, draft_restarts)

    def _observe_engine(self, engine: EngineStats | None, draft_restarts: int) -> None:
        if engine is not None:
            for attr, value in engine_gauges(engine):
                getattr(self, attr).labels(self._model).set(value)
            for field, attr in _ENGINE_COUNTERS.items():
                value = getattr(engine, field)
                if value > self._engine_seen[attr]:
                    self._inc_engine(attr, value - self._engine_seen[attr])
                    self._engine_seen[attr] = value
            for attr, fld, *_ in ENGINE_COUNTERS:
                value, seen = getattr(engine, fld), self._policy_seen.get(attr, 0)
                inc = value - seen if value >= seen else value  # a restarted draft counts from 0
                if inc > 0:
                    self._inc_engine(attr, inc)
                self._policy_seen[attr] = value
            self.round_choice.clear()
            for bucket, choice in engine.round_choices.items():
                self.round_choice.labels(self._model, str(bucket), choice).set(1)
            if self._mirror is not None:
                self._mirror.observe_engine(engine)
                self._mirror.set_round_choices(engine.round_choices)
        if draft_restarts > self._restarts_seen:
            if self._mirror is not None:
                self._mirror.observe_draft_restarts(draft_restarts - self._restarts_seen)
            self.draft_restarts.labels(self._model).inc(draft_restarts - self._restarts_seen)
            self._restarts_seen = draft_restarts

    def _inc_engine(self, attr: str, value: float) -> None:
        getattr(self, attr).labels(self._model).inc(value)
        if self._mirror is not None:
            self._mirror.inc_counter(attr, value)

    def render(self, engine: EngineStats | None, draft_restarts: int = 0) -> bytes:
        self.observe_engine(engine, draft_restarts)
        text = generate_latest(self.registry)
        if self._replica_id is not None:
            note = (f"# spec-runtime: the metrics of Ray Serve replica {self._replica_id} only; the sums over every "
                    "replica are Ray's ray_spec_runtime_* metrics (docs/ray.md).\n")
            text = note.encode() + text
        return text
