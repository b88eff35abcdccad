"""Server counters for Prometheus, through prometheus_client, served at GET /metrics (text format 0.0.4).

Counters only grow; ratios are left to the query (`rate(accepted) / rate(drafted)`), but the lifetime
acceptance rate and tokens per target forward are also given per method as gauges, present only once
something was drafted (unknown is not 0). The acceptance counters follow what other engines' users
read (vLLM's `spec_decode_num_accepted_tokens_per_pos`): drafted and accepted tokens per method, and
per draft position how many verifications accepted a token there, so
`accepted_at_position_total{position="k"} / verifications_total` is the rate at which the k-th drafted
token is accepted. The engine's prefix cache (`draftverify.prefix_cache`) is read when scraped: requests that reused
a cached prefix (hits) or found none (misses), prompt tokens reused, evictions, and the bytes and entries held. Each
app has a registry of its own (two apps in one process never mix counters).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from draftverify.stats import Stats

PER_METHOD = {  # counter name (prometheus_client adds `_total`) -> (help, Stats attribute)
    "prompt_tokens": ("Prompt tokens of finished generations.", "prompt_tokens"),
    "generated_tokens": ("Tokens generated (sent or cut off by a cancel).", "new_tokens"),
    "target_forwards": ("Forward passes of the target model.", "target_forwards"),
    "draft_forwards": ("Forward passes of the draft model.", "draft_forwards"),
    "drafted_tokens": ("Drafted tokens sent to verification.", "drafted"),
    "accepted_tokens": ("Drafted tokens the target accepted.", "accepted"),
}
MAX_POSITION = 32  # positions counted one by one; a longer accepted run counts its first MAX_POSITION


class Metrics:
    """The server's counters in a registry of their own (prometheus_client's metrics are thread-safe: the request
    handlers and the decoding thread both write)."""

    def __init__(self, prefix_cache=lambda: None):
        """`prefix_cache`: gives the engine's `PrefixCache` when scraped (None: no prefix cache, no counters)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.state = {"queue_depth": 0, "queue_capacity": 0, "busy": 0}  # read when scraped (`render`)
        self.totals: dict[str, dict[str, float]] = {}  # method -> {drafted, accepted, new_tokens, forwards}
        self.lock = threading.Lock()  # one generation's totals change together: a scrape never sees half of them

        def counter(name: str, help_: str, labels=("method",)) -> Counter:
            return Counter(f"draftverify_{name}", help_, labels, registry=self.registry)

        self.requests = counter("requests", "HTTP requests answered, by route and status code.", ("route", "status"))
        self.generations = counter(
            "generations",
            "Generations run, by method and finish reason (eos, stop, length, cancelled, error).",
            ("method", "finish_reason"),
        )
        self.per_method = {name: counter(name, help_) for name, (help_, _) in PER_METHOD.items()}
        self.verifications = counter("verifications", "Verifying target forwards (rounds that checked drafts).")
        self.at_position = counter(
            "accepted_at_position",
            "Verifications that accepted the drafted token at this position (1 = the first drafted token).",
            ("method", "position"),
        )
        self.seconds = counter("generation_seconds", "Seconds spent generating.")
        self.queue_wait = counter("queue_wait_seconds", "Seconds requests waited in line before generating.")
        for name, help_ in (
            ("queue_depth", "Requests waiting for the model."),
            ("queue_capacity", "The most requests that may wait (--max-queue)."),
            ("busy", "1 while a generation runs."),
        ):
            Gauge(f"draftverify_{name}", help_, registry=self.registry).set_function(lambda n=name: self.state[n])
        self.registry.register(_Ratios(self))
        self.registry.register(_PrefixCounters(prefix_cache))

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def generation(self, method: str, stats: Stats | None, wall_s: float, queue_s: float = 0.0) -> None:
        """Record one finished generation (`stats=None`: it failed with an error)."""
        self.generations.labels(method, stats.finish_reason if stats else "error").inc()
        self.seconds.labels(method).inc(wall_s)
        self.queue_wait.labels(method).inc(queue_s)
        for name, (_, attr) in PER_METHOD.items():
            self.per_method[name].labels(method).inc(getattr(stats, attr) if stats else 0)
        if stats is None:
            return
        with self.lock:
            totals = self.totals.setdefault(method, dict.fromkeys(("drafted", "accepted", "new_tokens", "forwards"), 0))
            for key, attr in (("drafted", "drafted"), ("accepted", "accepted"), ("new_tokens", "new_tokens")):
                totals[key] += getattr(stats, attr)
            totals["forwards"] += stats.target_forwards
        self.verifications.labels(method).inc(len(stats.steps))
        for emitted in stats.steps:  # a step's tokens: its accepted drafted tokens, then the bonus (or correction)
            for position in range(1, min(emitted - 1, MAX_POSITION) + 1):
                self.at_position.labels(method, str(position)).inc()

    def render(self, queue_depth: int, queue_capacity: int, busy: bool) -> str:
        self.state.update(queue_depth=queue_depth, queue_capacity=queue_capacity, busy=int(busy))
        return generate_latest(self.registry).decode()


class _Ratios:
    """The lifetime ratios per method as gauges, computed when scraped; absent while their denominator is 0."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        rate = GaugeMetricFamily(
            "draftverify_acceptance_rate", "accepted / drafted tokens since start.", labels=["method"]
        )
        per_forward = GaugeMetricFamily(
            "draftverify_tokens_per_target_forward",
            "generated tokens / target forwards since start.",
            labels=["method"],
        )
        with self.metrics.lock:
            totals = {method: dict(t) for method, t in self.metrics.totals.items()}
        for method, t in sorted(totals.items()):
            if t["drafted"]:
                rate.add_metric([method], t["accepted"] / t["drafted"])
            if t["forwards"]:
                per_forward.add_metric([method], t["new_tokens"] / t["forwards"])
        yield rate
        yield per_forward

    def describe(self):
        return []


PREFIX_COUNTERS = {  # PrefixCache counter -> (metric name, help)
    "hits": ("prefix_cache_hits", "Requests that reused a cached prefix of their prompt."),
    "misses": ("prefix_cache_misses", "Requests that found no cached prefix (their whole prompt prefilled)."),
    "tokens_reused": ("prefix_cache_reused_tokens", "Prompt tokens taken from the prefix cache, not prefilled."),
    "evictions": ("prefix_cache_evictions", "Prefix cache entries dropped to stay within the budget."),
}
PREFIX_GAUGES = {
    "nbytes": ("prefix_cache_bytes", "Bytes the prefix cache holds."),
    "entries": ("prefix_cache_entries", "Prefixes the prefix cache holds."),
    "budget": ("prefix_cache_budget_bytes", "The prefix cache's budget in bytes (--prefix-cache-mb)."),
}


class _PrefixCounters:
    """The engine's prefix cache counters, read when scraped; absent while the engine keeps no prefix cache."""

    def __init__(self, prefix_cache):
        self.prefix_cache = prefix_cache

    def collect(self):
        cache = self.prefix_cache()
        if cache is None:
            return
        values = {**cache.counters(), "budget": cache.budget}
        for key, (name, help_) in PREFIX_COUNTERS.items():
            yield CounterMetricFamily(f"draftverify_{name}", help_, value=values[key])
        for key, (name, help_) in PREFIX_GAUGES.items():
            yield GaugeMetricFamily(f"draftverify_{name}", help_, value=values[key])

    def describe(self):
        return []
