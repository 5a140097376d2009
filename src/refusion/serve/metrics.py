"""Prometheus metrics of the server, served at `GET /metrics` (docs/SERVING.md, Metrics).

Each app has its own `CollectorRegistry` (not prometheus_client's global one), so several apps in one
process (tests, benchmarks) count apart. The scheduler thread reports sequences through the
`SchedulerObserver` hooks; the HTTP handlers report requests through `RequestTimer`. prometheus_client
metrics are thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from refusion.serve.scheduler import Job, SchedulerObserver

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The Prometheus text exposition format (0.0.4), which every scraper reads."""

PREFIX = "refusion_"
PHASES = ("prefill", "plan", "verify", "complete", "decode")
"""Phases of `SequenceStats.phase_forwards`; their series exist (at 0) from the start."""
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKENS_PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
ROUTING_PREFIX = "vllm:"
"""The gauges routers read (llm-d's endpoint picker, the Gateway API inference extension's model-server
protocol) go under vLLM's names as well, labelled with `model_name` as vLLM labels them."""
UNKNOWN_STRATEGY = "unknown"
"""The `strategy` label of a request refused before its settings were read (malformed body, ...)."""


class ServerMetrics(SchedulerObserver):
    """Every metric of one server, in its own registry. Names and meanings: docs/SERVING.md, Metrics."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self.requests = Counter(f"{p}requests", "Generation requests answered, by HTTP status and strategy "
                                "(a stream by the status of how it ended: 499 client left, 500/503 error event)",
                                ["status", "strategy"], registry=r)
        self.queue_depth = Gauge(f"{p}queue_depth", "Sequences waiting for a batch row", registry=r)
        self.batch_size = Gauge(f"{p}batch_size", "Sequences in the running batch", registry=r)
        self.time_to_first_token = Histogram(
            f"{p}time_to_first_token_seconds", "Per sequence: from submission to its first committed contiguous "
            "token", registry=r, buckets=REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(
            f"{p}time_per_output_token_seconds", "Per finished sequence: (finish - first token) / (tokens - 1)",
            registry=r, buckets=TOKEN_LATENCY_BUCKETS)
        self.request_latency = Histogram(
            f"{p}e2e_request_latency_seconds", "Per queued request: from arrival to the end of its response",
            registry=r, buckets=REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of the sequences admitted into the "
                                     "batch (each of n choices counts its prompt)", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated (committed contiguous "
                                         "response tokens of every sequence that left the batch)", registry=r)
        self.forwards = Counter(f"{p}forwards", "Forwards the sequences took part in, by phase (a batched "
                                "forward counts once per sequence in it)", ["phase"], registry=r)
        self.drafted_tokens = Counter(f"{p}drafted_tokens", "Speculative strategy: drafted tokens verified",
                                      registry=r)
        self.accepted_tokens = Counter(f"{p}accepted_tokens", "Speculative strategy: drafted tokens accepted",
                                       registry=r)
        self.tokens_per_forward = Histogram(
            f"{p}tokens_per_forward", "Per finished sequence: generated tokens / forwards it took part in",
            registry=r, buckets=TOKENS_PER_FORWARD_BUCKETS)
        self.kv_cache_usage = Gauge(f"{p}kv_cache_usage_ratio", "Tokens held in the KV cache by the running "
                                    "sequences / what the server holds at most (max_batch_size x context length)",
                                    registry=r)
        self.prefix_cache_queries = Counter(
            f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache (every admitted sequence's "
            "prompt while the cache is on)", registry=r)
        self.prefix_cache_hits = Counter(f"{p}prefix_cache_hits", "Prompt tokens whose KV entries the prefix cache "
                                         "held (reused, not prefilled)", registry=r)
        self._vllm_prefix_counters: list[tuple] = []  # (queries, hits) under vLLM's names, once `watch` knows the model
        for phase in PHASES:
            self.forwards.labels(phase)

    def watch(self, queue_depth: Callable[[], int], batch_size: Callable[[], int],
              kv_cache_usage: Callable[[], float], model_name: str) -> None:
        """Read the gauges from the scheduler at scrape time, under refusion's names and vLLM's (`ROUTING_PREFIX`)."""
        self.queue_depth.set_function(queue_depth)
        self.batch_size.set_function(batch_size)
        self.kv_cache_usage.set_function(kv_cache_usage)
        v, r = ROUTING_PREFIX, self.registry
        aliases = {f"{v}num_requests_waiting": ("Sequences waiting for a batch row (= refusion_queue_depth)",
                                                queue_depth),
                   f"{v}num_requests_running": ("Sequences in the running batch (= refusion_batch_size)", batch_size),
                   f"{v}kv_cache_usage_perc": ("KV-cache usage, 0 to 1 (= refusion_kv_cache_usage_ratio)",
                                               kv_cache_usage),
                   f"{v}gpu_cache_usage_perc": ("KV-cache usage, 0 to 1 (= refusion_kv_cache_usage_ratio; vLLM's "
                                                "name before v0.10)", kv_cache_usage)}
        for name, (description, read) in aliases.items():
            Gauge(name, description, ["model_name"], registry=r).labels(model_name).set_function(read)
        self._vllm_prefix_counters = [tuple(
            Counter(name, description, ["model_name"], registry=r).labels(model_name) for name, description in (
                (f"{v}prefix_cache_queries", "Prefix cache queries, in prompt tokens (= refusion_prefix_cache_queries)"),
                (f"{v}prefix_cache_hits", "Prefix cache hits, in prompt tokens (= refusion_prefix_cache_hits)")))]

    def exposition(self) -> bytes:
        """The registry in the text exposition format."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ SchedulerObserver (scheduler thread)
    def sequence_admitted(self, job: Job) -> None:
        self.prompt_tokens.inc(len(job.prompt))
        cached = job.seq.stats.cached_tokens
        if cached is not None:  # looked up in the prefix cache
            for queries, hits in [(self.prefix_cache_queries, self.prefix_cache_hits), *self._vllm_prefix_counters]:
                queries.inc(len(job.prompt))
                hits.inc(cached)

    def first_token(self, job: Job) -> None:
        self.time_to_first_token.observe(job.first_token_at - job.submitted)

    def sequence_left(self, job: Job, outcome: str) -> None:
        stats = job.seq.stats if job.seq is not None else None
        self.generation_tokens.inc(job.tokens)
        if stats is None:
            return
        for phase, n in stats.phase_forwards.items():
            self.forwards.labels(phase).inc(n)
        self.drafted_tokens.inc(stats.drafted)
        self.accepted_tokens.inc(stats.accepted)
        if outcome != "completed":
            return
        if stats.forwards:
            self.tokens_per_forward.observe(job.tokens / stats.forwards)
        if job.tokens > 1 and job.first_token_at is not None:
            self.time_per_output_token.observe((time.perf_counter() - job.first_token_at) / (job.tokens - 1))


class RequestTimer:
    """One generation request, counted once by the status it ended with (`finish`)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.started = time.perf_counter()
        self.strategy = UNKNOWN_STRATEGY
        """Set once the request's settings are read."""
        self.queued = False
        """Whether its jobs reached the scheduler (only those requests have an end-to-end latency)."""
        self.finished = False

    def finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.requests.labels(str(status), self.strategy).inc()
        if self.queued:
            self.metrics.request_latency.observe(time.perf_counter() - self.started)
