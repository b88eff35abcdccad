"""Server counters in the Prometheus text format (version 0.0.4), served at GET /metrics.

Counters only grow; ratios are left to the query (`rate(accepted) / rate(drafted)`), but the
lifetime acceptance rate and tokens per target forward are also given per method as gauges,
present only once something was drafted (unknown is not 0).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

from draftverify.stats import Stats

PER_METHOD = {  # counter name suffix -> (help, Stats attribute)
    "prompt_tokens_total": ("Prompt tokens of finished generations.", "prompt_tokens"),
    "generated_tokens_total": ("Tokens generated (sent or cut off by a cancel).", "new_tokens"),
    "target_forwards_total": ("Forward passes of the target model.", "target_forwards"),
    "draft_forwards_total": ("Forward passes of the draft model.", "draft_forwards"),
    "drafted_tokens_total": ("Drafted tokens sent to verification.", "drafted"),
    "accepted_tokens_total": ("Drafted tokens the target accepted.", "accepted"),
}


class Metrics:
    """Thread-safe counters: the request handlers and the worker thread both write."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (route, status) -> count
        self.generations: Counter = Counter()  # (method, finish reason) -> count
        self.per_method: dict[str, Counter] = defaultdict(Counter)  # method -> {counter: value}

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, str(status))] += 1

    def generation(self, method: str, stats: Stats | None, wall_s: float, queue_s: float = 0.0) -> None:
        """Record one finished generation (`stats=None`: it failed with an error)."""
        with self._lock:
            self.generations[(method, stats.finish_reason if stats else "error")] += 1
            counters = self.per_method[method]
            counters["generation_seconds_total"] += wall_s
            counters["queue_wait_seconds_total"] += queue_s
            for name, (_, attr) in PER_METHOD.items():
                counters[name] += getattr(stats, attr) if stats else 0

    def render(self, queue_depth: int, queue_capacity: int, busy: bool) -> str:
        with self._lock:
            lines = []

            def family(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
                lines.append(f"# HELP draftverify_{name} {help_}")
                lines.append(f"# TYPE draftverify_{name} {kind}")
                for labels, value in samples:
                    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                    lines.append(f"draftverify_{name}{{{text}}} {value:g}" if text else f"draftverify_{name} {value:g}")

            family(
                "requests_total",
                "counter",
                "HTTP requests answered, by route and status code.",
                [({"route": r, "status": s}, n) for (r, s), n in sorted(self.requests.items())],
            )
            family("queue_depth", "gauge", "Requests waiting for the model.", [({}, queue_depth)])
            family("queue_capacity", "gauge", "The most requests that may wait (--max-queue).", [({}, queue_capacity)])
            family("busy", "gauge", "1 while a generation runs.", [({}, int(busy))])
            family(
                "generations_total",
                "counter",
                "Generations run, by method and finish reason (eos, stop, length, cancelled, error).",
                [({"method": m, "finish_reason": f}, n) for (m, f), n in sorted(self.generations.items())],
            )
            per_method = sorted(self.per_method.items())
            for name, (help_, _) in PER_METHOD.items():
                family(name, "counter", help_, [({"method": m}, c[name]) for m, c in per_method])
            family(
                "generation_seconds_total",
                "counter",
                "Seconds spent generating.",
                [({"method": m}, c["generation_seconds_total"]) for m, c in per_method],
            )
            family(
                "queue_wait_seconds_total",
                "counter",
                "Seconds requests waited in line before generating.",
                [({"method": m}, c["queue_wait_seconds_total"]) for m, c in per_method],
            )
            family(
                "acceptance_rate",
                "gauge",
                "accepted / drafted tokens since start.",
                [
                    ({"method": m}, c["accepted_tokens_total"] / c["drafted_tokens_total"])
                    for m, c in per_method
                    if c["drafted_tokens_total"]
                ],
            )
            family(
                "tokens_per_target_forward",
                "gauge",
                "generated tokens / target forwards since start.",
                [
                    ({"method": m}, c["generated_tokens_total"] / c["target_forwards_total"])
                    for m, c in per_method
                    if c["target_forwards_total"]
                ],
            )
            return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
