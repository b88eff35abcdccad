"""Markdown table cells of the report: a metric's median with its spread over repeats, or "n/a" / "unknown"."""

from __future__ import annotations


def fmt(value, spec: str, unknown: bool) -> str:
    return ("unknown" if unknown else "n/a") if value is None else format(value, spec)


def cell(metric: dict, spec: str, unknown: bool, scale: float = 1.0, unit: str = "") -> str:
    """'1.23x' or, over several repeats that disagree, '1.23x [1.20, 1.25]'."""
    if metric["median"] is None:
        return fmt(None, spec, unknown)
    text = format(metric["median"] * scale, spec) + unit
    if metric["n"] > 1 and metric["min"] != metric["max"]:
        text += f" [{format(metric['min'] * scale, spec)}, {format(metric['max'] * scale, spec)}]"
    return text


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
