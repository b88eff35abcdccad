"""The server's /metrics counters (serve/metrics.py), read back with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from draftverify.serve.metrics import Metrics
from draftverify.stats import Stats


def samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def finished(steps: list[int], drafted: int, reason: str = "length") -> Stats:
    stats = Stats(finish_reason=reason, prompt_tokens=5, new_tokens=sum(steps), target_forwards=len(steps) + 1)
    stats.drafted, stats.accepted, stats.steps = drafted, sum(s - 1 for s in steps), steps
    return stats


def test_acceptance_counters_per_method_and_position():
    metrics = Metrics()
    metrics.generation("speculative", finished([3, 1, 2], drafted=9), wall_s=0.5, queue_s=0.25)
    metrics.generation("speculative", finished([4], drafted=3), wall_s=0.5)
    metrics.generation("autoregressive", finished([1, 1], drafted=0), wall_s=0.1)
    metrics.generation("speculative", None, wall_s=0.1)  # a failed generation counts, drafts nothing
    metrics.request("/v1/completions", 200)
    got = samples(metrics.render(queue_depth=2, queue_capacity=16, busy=True))
    spec = (("method", "speculative"),)

    def at(position: int) -> float:
        return got.get(
            ("draftverify_accepted_at_position_total", (("method", "speculative"), ("position", str(position)))), 0
        )

    assert [at(p) for p in (1, 2, 3, 4)] == [3, 2, 1, 0]  # steps 3, 1, 2, 4 accept 2, 0, 1, 3 drafted tokens
    assert got[("draftverify_verifications_total", spec)] == 4
    assert (
        got[("draftverify_drafted_tokens_total", spec)] == 12 and got[("draftverify_accepted_tokens_total", spec)] == 6
    )
    assert got[("draftverify_acceptance_rate", spec)] == 0.5
    assert got[("draftverify_tokens_per_target_forward", spec)] == 10 / 6
    assert ("draftverify_acceptance_rate", (("method", "autoregressive"),)) not in got  # nothing drafted: unknown
    assert got[("draftverify_generations_total", (("finish_reason", "error"), ("method", "speculative")))] == 1
    assert got[("draftverify_queue_wait_seconds_total", spec)] == 0.25
    assert got[("draftverify_queue_depth", ())] == 2 and got[("draftverify_busy", ())] == 1
    assert got[("draftverify_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 1


def test_two_apps_keep_their_own_counters():
    one, two = Metrics(), Metrics()
    one.generation("speculative", finished([2], drafted=1), wall_s=0.1)
    assert ("draftverify_drafted_tokens_total", (("method", "speculative"),)) not in samples(two.render(0, 1, False))
