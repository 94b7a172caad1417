"""``/metrics``: the engine's figures and the server's request timings in Prometheus' text format.

Two sources. The engine's own state (queues, KV blocks, prefix-cache totals, preemptions) is read
from ``engine.stats()`` when Prometheus scrapes, so it is never stale and costs nothing between
scrapes. What only the server sees (time to first token and per output token as a client gets
them, tokens streamed, requests by how they ended) is recorded as requests run.

Each app has its own CollectorRegistry, never prometheus_client's global one, so that two apps in
one process (tests, a script serving two engines) keep separate figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from localpaged.engine.protocol import EngineStats

PREFIX = "localpaged_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# EngineStats field -> (metric name without the prefix, help); gauges are levels, counters running totals.
GAUGES = {
    "running": ("requests_running", "Requests in the running batch."),
    "waiting": ("requests_waiting", "Requests queued for admission."),
    "blocks_total": ("kv_blocks_total", "KV blocks in the pool."),
    "blocks_used": ("kv_blocks_used", "KV blocks held by requests in flight."),
    "blocks_cached": ("kv_blocks_cached", "Free KV blocks that still hold a cached prefix."),
    "blocks_shared": ("kv_blocks_shared", "KV blocks held by more than one request."),
    "block_bytes": ("kv_block_bytes", "Bytes of one KV block (all layers)."),
    "disk_blocks": ("kv_disk_blocks", "KV blocks in the disk tier."),
    "disk_bytes": ("kv_disk_bytes", "Bytes of the disk tier's block files."),
}
COUNTERS = {
    "prefix_query_tokens": ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache."),
    "prefix_hit_tokens": ("prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache."),
    "disk_tokens": ("prefix_cache_disk_hits_tokens", "Prompt tokens read from the disk KV tier."),
    "disk_blocks_written": ("kv_disk_blocks_written", "KV blocks written to the disk tier."),
    "preemptions": ("preemptions", "Requests preempted (blocks given back, recomputed later)."),
    "spec_proposed_tokens": ("spec_decode_draft_tokens", "Draft tokens checked by speculative decoding."),
    "spec_accepted_tokens": ("spec_decode_accepted_tokens", "Draft tokens speculative decoding kept."),
}


class EngineCollector(Collector):
    """The engine's figures, read from ``stats()`` at scrape time; a figure the engine lacks is left out."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.stats()
        except Exception:  # noqa: BLE001 -- the engine is gone: say so, and keep serving the server's own figures
            stats = None
        yield GaugeMetricFamily(
            PREFIX + "engine_up", "1 while the engine answers, else 0.", value=1.0 if stats is not None else 0.0
        )
        if stats is None:
            return
        for key, (name, help_text) in GAUGES.items():
            if (value := getattr(stats, key)) is not None:
                yield GaugeMetricFamily(PREFIX + name, help_text, value=value)
        for key, (name, help_text) in COUNTERS.items():
            if (value := getattr(stats, key)) is not None:
                yield CounterMetricFamily(PREFIX + name, help_text, value=value)


class ServerMetrics:
    """The registry behind one app's ``/metrics``, and what the request handlers record into it."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From a request's arrival at the server to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Per request: the mean time between its generated tokens after the first.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated for HTTP clients.", registry=self.registry
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests served.", registry=self.registry
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Requests that ended, by finish_reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The text exposition (blocking: it asks the engine for its stats; call it off the event loop)."""
        return generate_latest(self.registry)
