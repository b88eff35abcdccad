"""How a forward's time grows with its context: every new token's attention reads every cached one."""

from __future__ import annotations


def context_slope(near: dict[int, float], far: dict[int, float], span: int) -> dict[int, float]:
    """Per width, the seconds per token of context from two tables measured `span` tokens apart: the
    per-width growth fitted as a + b w with a, b >= 0 (one line through noisy differences; attention's
    cost is a fixed part per forward plus a part per new token)."""
    widths = sorted(near)
    growth = [(far[w] - near[w]) / span for w in widths]
    mean_w, mean_g = sum(widths) / len(widths), sum(growth) / len(growth)
    spread = sum((w - mean_w) ** 2 for w in widths)
    b = max(0.0, sum((w - mean_w) * (g - mean_g) for w, g in zip(widths, growth)) / spread) if spread else 0.0
    a = max(0.0, mean_g - b * mean_w)
    return {w: a + b * w for w in widths}
