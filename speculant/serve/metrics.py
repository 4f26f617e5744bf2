"""Prometheus metrics of a server (`GET /metrics`), in a registry of its own per app."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
POSITIONS = 16  # draft positions counted one by one; later ones count at the last


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("speculant_requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("speculant_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("speculant_completion_tokens", "tokens generated", registry=r)
        self.drafted = Counter("speculant_draft_tokens", "draft tokens verified, by draft position (a tree's nodes "
                               "by depth)", ["position"], registry=r)
        self.accepted = Counter("speculant_accepted_tokens", "draft tokens accepted, by draft position (a tree's "
                                "accepted path by depth)", ["position"], registry=r)
        self.ttft = Histogram("speculant_time_to_first_token_seconds", "from the engine taking a request (its body "
                              "read, its prompt encoded) to its first token (queueing and prefill included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("speculant_inter_token_latency_seconds", "between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("speculant_queue_depth", "requests waiting for a batch slot", registry=r)
        self.batch_rows = Histogram("speculant_batch_rows", "requests' calls run by one model forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.batch_tokens = Histogram("speculant_batch_tokens", "tokens run by one model forward",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.prefix_lookups = Counter("speculant_prefix_cache_lookups", "prefills that looked for a cached prefix",
                                      registry=r)
        self.prefix_hits = Counter("speculant_prefix_cache_hits", "prefills that started from a cached prefix",
                                   registry=r)
        self.prefix_tokens = Counter("speculant_prefix_cache_saved_tokens", "prompt positions restored from the "
                                     "prefix cache instead of computed", registry=r)
        self.prefix_bytes = Gauge("speculant_prefix_cache_bytes", "memory the prefix cache holds", registry=r)
        self.forward_seconds = Counter("speculant_forward_seconds", "seconds the worker spent in model forwards "
                                       "(the rest of its time: requests' own Python, or idle)", registry=r)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def usage(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def step(self, depths: Sequence[int], accepted: int) -> None:
        """One verification: a draft token verified at each of `depths` (1: the first after the last committed
        token; a tree has several at a depth), one accepted at each depth 1..`accepted`. Depth d counts at position
        d - 1."""
        for depth in depths:
            self.drafted.labels(str(min(depth - 1, POSITIONS - 1))).inc()
        for j in range(accepted):
            self.accepted.labels(str(min(j, POSITIONS - 1))).inc()

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def batch(self, rows: int, tokens: int, seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.batch_tokens.observe(tokens)
        self.forward_seconds.inc(seconds)

    def prefix(self, hit: bool, tokens: int) -> None:
        """A prefill's lookup in the prefix cache: `tokens` positions restored."""
        self.prefix_lookups.inc()
        if hit:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
