"""What `draftverify load` writes: results.json, report.md (a table per method and concurrency) and
tokens_per_s.png, each atomically, from the results object that `draftverify.serve.load.load` returns."""

from __future__ import annotations

import json
from pathlib import Path

from draftverify.serve.load_format import describe
from draftverify.util import atomic_write


def report(results: dict) -> str:
    """report.md: the command, the server and settings, one table row per (method, concurrency) run, then the
    tokens/s of each later method against the first at each concurrency."""
    lines = ["# draftverify load", "", "```", results["command"] or "(not run from a shell)", "```", ""]
    lines += header(results) + [""] + table(results["runs"])
    ratios = ratio_lines(results["runs"])
    lines += [""] + ratios if ratios else []
    return "\n".join(lines + ["", "![tokens/s against concurrency](tokens_per_s.png)", ""])


def header(results: dict) -> list[str]:
    """The bullet list under the command: server, settings, the request format and what the columns mean."""
    settings = results["settings"]
    lines = [
        f"- server: {results['server']}; model `{results['model']}`",
        f"- {settings['requests']} requests per run, {settings['max_tokens']} new tokens at most, greedy, "
        f"streamed; prompts: {settings['prompts']}",
    ]
    if settings.get("system"):
        lines.append(f"- system message: {settings['system']!r}")
    if settings.get("response_format") is not None:
        lines.append(
            f"- response_format: `{settings.get('response_format_file') or '(inline)'}` "
            f"({describe(settings['response_format'])}); invalid: outputs that do not parse as JSON or do not "
            "validate against the schema (a reply cut at the token limit does not)"
        )
    return lines + [
        "- tokens/s = all completion tokens of a run / its wall time (aggregate over clients); latency and TTFT "
        "per request; text gap: every wait between two pieces of a streamed reply, over all requests of the run "
        "(a stream that stalls while another request's prompt is read shows here).",
        "- mismatches: greedy outputs that differ from the same prompt's output at the lowest concurrency of the "
        "same method (for that run: the first method's).",
    ]


def table(runs: list[dict]) -> list[str]:
    """One row per run; `vs 1 client` is against the method's first (lowest) concurrency; invalid is `-` when no
    JSON format was sent (unknown, not 0)."""
    lines = [
        "| method | concurrency | requests | errors | tokens/s | vs 1 client | latency p50 / p99 (s) "
        "| TTFT p50 / p99 (s) | text gap p99 / max (s) | mismatches | invalid |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def sec(x):
        return "-" if x is None else f"{x:.2f}"

    base = {}
    for run in runs:
        base.setdefault(run["method"], run["tokens_per_s"])
        ratio = run["tokens_per_s"] / base[run["method"]] if base[run["method"]] else 0.0
        invalid = run.get("invalid")
        lines.append(
            f"| `{run['method']}` | {run['concurrency']} | {run['requests']} | {run['errors']} "
            f"| {run['tokens_per_s']:.1f} | {ratio:.2f}x "
            f"| {sec(run['latency_p50_s'])} / {sec(run['latency_p99_s'])} "
            f"| {sec(run['ttft_p50_s'])} / {sec(run['ttft_p99_s'])} "
            f"| {sec(run.get('gap_p99_s'))} / {sec(run.get('gap_max_s'))} | {run['mismatches']} "
            f"| {'-' if invalid is None else invalid} |"
        )
    return lines


def ratio_lines(runs: list[dict]) -> list[str]:
    """At each concurrency with 2+ methods: each later method's tokens/s over the first method's, one line each
    (none where the first method's run produced no tokens)."""
    first: dict[int, dict] = {}
    lines = []
    for run in runs:
        ref = first.setdefault(run["concurrency"], run)
        if ref is run or not ref["tokens_per_s"]:
            continue
        clients = "1 client" if run["concurrency"] == 1 else f"{run['concurrency']} clients"
        lines.append(
            f"- `{run['method']}` / `{ref['method']}` at {clients}: "
            f"{run['tokens_per_s'] / ref['tokens_per_s']:.2f}x tokens/s"
        )
    return lines


def plot(results: dict) -> bytes:
    """tokens_per_s.png: aggregate tokens/s against concurrent clients, one line per method."""
    from draftverify.bench.plots import _png, plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in results["runs"]):
        runs = [r for r in results["runs"] if r["method"] == method]
        ax.plot([r["concurrency"] for r in runs], [r["tokens_per_s"] for r in runs], marker="o", label=method)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{results['model']}: throughput under load")
    ax.legend(fontsize=8)
    return _png(fig)


def write(out: Path, results: dict) -> None:
    """results.json, report.md and tokens_per_s.png in `out`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.json", json.dumps(results, indent=1))
    atomic_write(out / "report.md", report(results))
    atomic_write(out / "tokens_per_s.png", plot(results))
