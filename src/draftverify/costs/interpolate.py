"""Reading a cost table between its measured widths: linear between points, extended linearly beyond; and the
marginal time a forward's extra rows add. Pure functions of the table's (width, seconds) points in ascending order."""

from __future__ import annotations


def between(points: list[tuple[int, float]], width: int) -> float:
    """t(width) from (width, seconds) points in ascending order: linear between points, extended linearly beyond."""
    if len(points) == 1:
        return points[0][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if width <= w1 or (w1, t1) == points[-1]:
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
    raise AssertionError("unreachable")


def marginal(points: list[tuple[int, float]], width: int, others: int) -> float:
    """Seconds `width` rows add to a forward that carries `others` rows of other sequences (alone: t(width)); never
    below a twentieth of t(1) per row: a measured curve can dip."""
    if others <= 0:
        return between(points, width)
    return max(between(points, others + width) - between(points, others), 0.05 * width * between(points, 1))


def ascending(table: dict[int, float]) -> list[tuple[int, float]]:
    """A table's (width, seconds) points in ascending order (widths may be text: JSON keys)."""
    return sorted((int(w), t) for w, t in table.items())
