"""The run's two figures (matplotlib, Agg backend), returned as PNG bytes."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _empty(message: str) -> bytes:
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.text(0.5, 0.5, message, ha="center", va="center")
    ax.set_axis_off()
    return _png(fig)


def speedup_chart(results: dict) -> bytes:
    """Grouped bars: geometric-mean speedup over autoregressive per method, for all prompts
    and each category; error bars span the repeats' min and max."""
    labels = [m["label"] for m in results["methods"] if m["label"] != results["baseline"]]
    groups = {"all": results["summary"]["all"], **results["summary"]["categories"]}
    if not labels:
        return _empty("only the autoregressive baseline was run")
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * (1 + 0.25 * len(labels))), 4.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs, heights, low, high = [], [], [], []
        for i, summary in enumerate(groups.values()):
            metric = summary.get(label, {}).get("speedup")
            if metric is None or metric["median"] is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            heights.append(metric["median"])
            low.append(metric["median"] - metric["min"])
            high.append(metric["max"] - metric["median"])
        ax.bar(xs, heights, width, yerr=[low, high], capsize=2, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right")
    ax.set_ylabel("speedup over autoregressive (geomean)")
    ax.set_title(f"{results['config']['target']}: speedup per method and category")
    ax.legend(fontsize=8)
    return _png(fig)


def accepted_histogram(results: dict) -> bytes:
    """Per method, the share of verification steps that emitted 1, 2, 3... tokens (bonus included)."""
    steps: dict[str, list[int]] = {}
    for r in results["records"]:
        if r["label"] != results["baseline"] and r["steps"]:
            steps.setdefault(r["label"], []).extend(r["steps"])
    if not steps:
        return _empty("no method recorded tokens per verification step")
    fig, axes = plt.subplots(len(steps), 1, figsize=(6, 1.9 * len(steps) + 0.6), sharex=True, squeeze=False)
    top = max(max(v) for v in steps.values())
    for ax, (label, values) in zip(axes[:, 0], steps.items()):
        ax.hist(values, bins=[b - 0.5 for b in range(1, top + 2)], weights=[1 / len(values)] * len(values), rwidth=0.85)
        ax.set_ylabel("share of steps")
        ax.set_title(f"{label}: mean {sum(values) / len(values):.2f} tokens per step", fontsize=9)
    axes[-1, 0].set_xlabel("tokens emitted per target verification forward (accepted drafts + 1)")
    return _png(fig)
