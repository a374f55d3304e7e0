"""`GET /metrics`: the engine's state and the requests' latencies, in Prometheus' exposition format.

Gauges and token counters follow the server's `Stats` after every engine
step (on the engine thread; prometheus_client is thread-safe); latencies
are observed by the HTTP side as each request's tokens arrive.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvattn.serving.requests import Stats

__all__ = ["Metrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """One registry per app, so several servers in one process do not mix."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("kvattn_requests_running", "Requests holding a sequence.", registry=registry)
        self.waiting = Gauge("kvattn_requests_waiting", "Requests queued for a sequence.", registry=registry)
        self.pages_used = Gauge("kvattn_pages_used", "Pages referenced by a running sequence.", registry=registry)
        self.pages_free = Gauge("kvattn_pages_free", "Pages neither referenced nor cached.", registry=registry)
        self.pages_cached = Gauge("kvattn_pages_cached", "Unreferenced pages kept for the prefix cache.",
                                  registry=registry)
        self.hit_rate = Gauge("kvattn_prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache over prompt tokens admitted.", registry=registry)
        self.prompt_tokens = Counter("kvattn_prompt_tokens", "Prompt tokens admitted (recomputations included).",
                                     registry=registry)
        self.cached_tokens = Counter("kvattn_prompt_tokens_cached", "Admitted prompt tokens the prefix cache held.",
                                     registry=registry)
        self.generated_tokens = Counter("kvattn_generation_tokens", "Tokens generated.", registry=registry)
        self.drafted_tokens = Counter("kvattn_spec_draft_tokens", "Drafted tokens speculative rounds verified.",
                                      registry=registry)
        self.accepted_tokens = Counter("kvattn_spec_accepted_tokens", "Drafted tokens the model kept.",
                                       registry=registry)
        self.requests = Counter("kvattn_requests", "Finished requests, by finish reason.", ["finish_reason"],
                                registry=registry)
        self.rejected = Counter("kvattn_requests_rejected", "Requests refused before running, by HTTP status.",
                                ["status"], registry=registry)
        self.engine_errors = Counter("kvattn_engine_errors", "Engine steps that failed.", registry=registry)
        self.ttft = Histogram("kvattn_time_to_first_token_seconds", "From arrival to the first token.",
                              buckets=_LATENCY, registry=registry)
        self.itl = Histogram("kvattn_inter_token_latency_seconds", "Between two tokens of one choice.",
                             buckets=_LATENCY, registry=registry)
        self.e2e = Histogram("kvattn_e2e_request_latency_seconds", "From arrival to the last token.",
                             buckets=_LATENCY, registry=registry)
        self._totals = Stats(0, 0, 0, 0, 0, 0, 0, 0)

    def on_step(self, stats: Stats) -> None:
        """After an engine step: gauges to the server's state, counters by what grew."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.pages_used.set(stats.pages_live)
        self.pages_free.set(stats.pages_free)
        self.pages_cached.set(stats.pages_cached)
        self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0)
        self.prompt_tokens.inc(stats.prompt_tokens - self._totals.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens - self._totals.cached_tokens)
        self.generated_tokens.inc(stats.generated_tokens - self._totals.generated_tokens)
        self.drafted_tokens.inc(stats.drafted_tokens - self._totals.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens - self._totals.accepted_tokens)
        self._totals = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
