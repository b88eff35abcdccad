"""The SpecDec++ paper's Pareto view of a bench run (`draftverify pareto RESULTS.json`).

Huang et al. 2024 (Figure 4) compare draft-length rules on two hardware-free rates per
generated token: the verification rate (target forwards / generated tokens) and the discard
rate (discarded drafts / generated tokens); time per token is a weighted sum of the two (their
eq. 2.3). This reads a `draftverify bench` results.json, summarises each method per data set
and over all prompts with the bench's own formulas (`bench.metrics.summarize`), marks the
methods that no other method beats on both rates (the Pareto frontier), and writes
pareto.md and pareto.png. Methods that differ only in h or k are drawn as one line.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Optional

import typer

from draftverify.util import optional_import

RATES = ("target_forwards_per_token", "discarded_per_token")


def pareto_tables(results: dict) -> dict[str, list[dict]]:
    """Data set (and "all") -> one row per method: label, series, the two rates, tokens/s, speedup, frontier."""
    from draftverify.bench.metrics import summarize

    baseline = results["baseline"]
    groups = {"all": results["records"]}
    for r in results["records"]:
        groups.setdefault(r["dataset"], []).append(r)
    tables = {}
    for name, records in groups.items():
        summary = summarize(records, baseline)
        rows = []
        for m in results["methods"]:
            s = summary.get(m["label"])
            if m["label"] == baseline or s is None or any(s[k]["median"] is None for k in RATES):
                continue
            rows.append(
                {
                    "label": m["label"],
                    "series": series_of(m["label"]),
                    "verification_rate": s["target_forwards_per_token"]["median"],
                    "discard_rate": s["discarded_per_token"]["median"],
                    "tokens_per_s": s["tokens_per_s"]["median"],
                    "speedup": s["speedup"]["median"],
                }
            )
        on_front = frontier([(r["verification_rate"], r["discard_rate"]) for r in rows])
        for row, front in zip(rows, on_front):
            row["frontier"] = front
        tables[name] = rows
    return tables


def series_of(label: str) -> str:
    """The label without its h / k setting: `specdec-pp[h=0.3,head=wrej3]` -> `specdec-pp[head=wrej3]`."""
    name, _, options = label.partition("[")
    name = name.split(":")[0] if ":h0." in name or ":k" in name else name
    kept = [o for o in options.rstrip("]").split(",") if o and o.split("=")[0].strip() not in ("h", "k")]
    return name + (f"[{','.join(kept)}]" if kept else "")


def setting_of(label: str) -> str:
    """The h or k setting in a label, for the plot's point labels: `speculative[k=4]` -> `k=4`."""
    m = re.search(r"[\[,]\s*([hk])\s*=\s*([0-9.]+)", label) or re.search(r":([hk])([0-9.]+)", label)
    return f"{m[1]}={m[2]}" if m else label


def frontier(points: list[tuple[float, float]]) -> list[bool]:
    """For each (a, b) point (lower is better on both): is no other point at least as good on
    both and better on one?"""
    return [
        not any(a2 <= a and b2 <= b and (a2 < a or b2 < b) for j, (a2, b2) in enumerate(points) if j != i)
        for i, (a, b) in enumerate(points)
    ]


def to_markdown(tables: dict[str, list[dict]], source: str) -> str:
    def fmt(x, spec):
        return "unknown" if x is None else format(x, spec)

    out = [
        "# Verification rate vs discard rate (the SpecDec++ paper's Pareto view)",
        "",
        f"From `{source}`. Verification rate = target forwards per generated token; discard rate = discarded",
        "drafts per generated token (both lower is better; medians over repeats). `*` = on the Pareto frontier:",
        "no other method has both rates at least as low. tokens/s and speedup are the bench's own figures.",
        "",
        "![pareto](pareto.png)",
    ]
    for name, rows in tables.items():
        out += [
            "",
            f"## {name}",
            "",
            "| method | verification rate | discard rate | tokens/s | speedup | frontier |",
            "|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: r["verification_rate"]):
            out.append(
                f"| `{r['label']}` | {r['verification_rate']:.3f} | {r['discard_rate']:.3f} | "
                f"{fmt(r['tokens_per_s'], '.1f')} | "
                f"{fmt(r['speedup'], '.2f')}x | {'*' if r['frontier'] else ''} |"
            )
    return "\n".join(out) + "\n"


def pareto_plot(tables: dict[str, list[dict]]) -> bytes:
    """One panel per data set: discard rate (x) against verification rate (y), a line per series."""
    matplotlib = optional_import("matplotlib", "bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], tables.items()):
        for series in dict.fromkeys(r["series"] for r in rows):
            pts = sorted((r["discard_rate"], r["verification_rate"], r["label"]) for r in rows if r["series"] == series)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=series)
            for x, y, label in pts:
                ax.annotate(setting_of(label), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("discard rate (discarded drafts / token)")
        ax.set_ylabel("verification rate (target forwards / token)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def pareto_command(
    results: Path = typer.Argument(..., help="A results.json written by `draftverify bench`."),
    out: Optional[Path] = typer.Option(
        None, help="Output folder for pareto.md and pareto.png. Default: the results' folder."
    ),
):
    """Draw the SpecDec++ paper's Pareto view of a bench run: verification rate vs discard rate per method."""
    from draftverify.errors import DraftVerifyError, require
    from draftverify.util import atomic_write

    require(results.is_file(), f"{results} does not exist: pass the results.json of a `draftverify bench` run")
    try:
        data = json.loads(results.read_text())
        tables = pareto_tables(data)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DraftVerifyError(
            f"{results} is not a bench results.json ({type(exc).__name__}: {exc}): rerun `draftverify bench`"
        ) from None
    require(any(tables.values()), f"{results} has no method with drafts to compare: bench some draft methods first")
    out = out or results.parent
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "pareto.md", to_markdown(tables, str(results)))
    atomic_write(out / "pareto.png", pareto_plot(tables))
    typer.echo(f"wrote {out / 'pareto.md'} and {out / 'pareto.png'}")
