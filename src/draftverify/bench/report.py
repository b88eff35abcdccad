"""Writing a run's results: results.json, results.csv, report.md, speedup.png, accepted_hist.png.

Every file is written to a temporary name and renamed, so a reader never sees half a file.
In the tables "n/a" means not applicable (e.g. the acceptance rate of a method that drafts
nothing) and "unknown" a figure a transformers peer does not expose.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from draftverify.bench.cells import cell, table
from draftverify.bench.datasets import category_key
from draftverify.bench.metrics import first_divergence
from draftverify.bench.sections import (
    ceiling_section,
    cost_curve_section,
    exactness_section,
    oracle_section,
    winners_section,
)
from draftverify.util import atomic_write

CSV_FIELDS = (
    "prompt_id",
    "dataset",
    "category",
    "turn",
    "repeat",
    "label",
    "method",
    "prompt_tokens",
    "new_tokens",
    "wall_s",
    "tokens_per_s",
    "ttft_s",
    "target_forwards",
    "draft_forwards",
    "drafted",
    "accepted",
    "steps",
    "draft_s",
    "verify_s",
    "finish_reason",
    "peak_mem_bytes",
    "mem_kind",
    "first_divergence",
)


def jsonable(value):
    """JSON fallback for what methods may leave in `Stats.extra`: tensors and numpy values, else text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def write_all(results: dict, out_dir: Path) -> list[Path]:
    """Write every output file of a run into `out_dir`; returns their paths."""
    from draftverify.bench.plots import accepted_histogram, speedup_chart

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "results.json": json.dumps(results, indent=1, default=jsonable),
        "results.csv": to_csv(results),
        "report.md": to_markdown(results),
        "speedup.png": speedup_chart(results),
        "accepted_hist.png": accepted_histogram(results),
    }
    for name, data in files.items():
        atomic_write(out_dir / name, data)
    return [out_dir / name for name in files]


def to_csv(results: dict) -> str:
    """One row per generation; `first_divergence` is empty when the tokens equal the baseline's."""
    base = {(r["prompt_id"], r["repeat"]): r["tokens"] for r in results["records"] if r["label"] == results["baseline"]}
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in results["records"]:
        row = dict(r)
        row["tokens_per_s"] = r["new_tokens"] / r["wall_s"] if r["wall_s"] else None
        row["steps"] = "" if r["steps"] is None else " ".join(map(str, r["steps"]))
        reference = base.get((r["prompt_id"], r["repeat"]))
        if results["greedy"] and reference is not None:
            row["first_divergence"] = first_divergence(reference, r["tokens"])
        writer.writerow(row)
    return buf.getvalue()


# -- markdown -----------------------------------------------------------------------------


def _speed_rows(results: dict, summary: dict, exact: dict | None) -> list[list[str]]:
    rows = []
    for m in results["methods"]:
        s = summary.get(m["label"])
        if s is None:
            continue
        peer = m["peer"]
        cells = [
            f"`{m['label']}`",
            cell(s["speedup"], ".2f", peer, unit="x"),
            cell(s["decode_speedup"], ".2f", peer, unit="x"),
            cell(s["total_speedup"], ".2f", peer, unit="x"),
            cell(s["tokens_per_s"], ".1f", peer),
            cell(s["tokens_per_target_forward"], ".2f", peer),
            cell(s["acceptance_rate"], ".2f", peer),
        ]
        if exact is not None:
            cells.append(_same_tokens(exact.get(m["label"]), m["label"] == results["baseline"]))
        rows.append(cells)
    return rows


def _same_tokens(e: dict | None, baseline: bool) -> str:
    if baseline:
        return "baseline"
    return "n/a" if e is None else "yes" if not e["differ"] else f"**NO ({e['differ']})**"


def _cost_rows(results: dict, summary: dict) -> list[list[str]]:
    rows = []
    t1 = next(iter((results["cost_model"] or {}).get("target", {}).values()), None)  # one 1-token target forward
    for m in results["methods"]:
        s, peer = summary[m["label"]], m["peer"]
        split = [s["draft_share"], s["verify_share"], s["other_share"]]
        split_text = (
            "unknown"
            if any(x["median"] is None for x in split)
            else " / ".join(f"{x['median'] * 100:.0f}%" for x in split)
        )
        mem = s["peak_mem_bytes"]
        rows.append(
            [
                f"`{m['label']}`",
                cell(s["target_forwards_per_token"], ".3f", peer),
                cell(s["draft_forwards_per_token"], ".3f", peer),
                cell(s["discarded_per_token"], ".3f", peer),
                _per_drafted(s.get("draft_s_per_drafted"), t1),
                split_text,
                cell(s["ttft_p50_s"], ".1f", peer, scale=1000),
                cell(s["latency_p50_s"], ".1f", peer, scale=1000)
                + " / "
                + cell(s["latency_p99_s"], ".1f", peer, scale=1000),
                "unknown" if mem is None else f"{mem / 2**20:.0f}",
            ]
        )
    return rows


def _per_drafted(spread: dict | None, t1: float | None) -> str:
    if spread is None or spread["median"] is None:
        return "-"
    ms = spread["median"] * 1000
    return f"{ms:.2f}" + (f" ({spread['median'] / t1:.3f}x)" if t1 else "")


SPEED_HEADER = [
    "method",
    "speedup",
    "decode-only speedup",
    "total-time speedup",
    "tokens/s",
    "tokens per target forward",
    "acceptance rate",
]
COST_HEADER = [
    "method",
    "target forwards/token",
    "draft forwards/token",
    "discarded/token",
    "draft time per drafted token (ms, x target forward)",
    "time draft / verify / other",
    "TTFT p50 (ms)",
    "per-token latency p50 / p99 (ms)",
]
MEMORY_LABELS = {
    "cuda_max_allocated": "CUDA max allocated",
    "process_peak_rss": "process peak RSS",
    "process_max_rss_growth": "process max-RSS growth",
}


def header_lines(results: dict) -> list[str]:
    """The title, the command and what ran: models, arithmetic, machine, prompts, sampling."""
    cfg, env = results["config"], results["environment"]
    sampling = "greedy"
    if not results["greedy"]:
        sampling = f"sampling (temperature {cfg['temperature']}, top-k {cfg['top_k']}, top-p {cfg['top_p']}, "
        sampling += f"seed {cfg['seed']})"
    hardware = env["gpu"] or env["cpu"] or env["platform"]
    arithmetic = cfg.get("arithmetic") or cfg["dtype"].replace("torch.", "")
    versions = f"torch {env['torch']}, transformers {env['transformers']}, draftverify {env['draftverify']}"
    models = f"- target `{cfg['target']}`, draft `{cfg['draft'] or 'none'}`"
    models += f", feature head `{cfg['head']}`" if cfg.get("head") else ""
    return [
        f"# draftverify bench: {cfg['target']}",
        "",
        "```",
        results["command"] or "(run from Python)",
        "```",
        "",
        f"{models}; target arithmetic **{arithmetic}** (weights {cfg['dtype'].replace('torch.', '')}), "
        f"on {env['device']} ({hardware}), {env['torch_threads']} threads; {versions}"
        + (f" ({env['git_commit']})" if env.get("git_commit") else ""),
        *([f"- llama.cpp peers: {env['llamacpp']}"] if env.get("llamacpp") else []),
        f"- {len(results['prompts'])} prompts ({len(results['skipped'])} skipped), "
        f"{cfg['max_new_tokens']} new tokens at most, {cfg['repeats']} repeat(s), {sampling}; "
        "methods interleaved prompt by prompt after a warm-up",
        "- speedup = geometric mean over prompts of (autoregressive time / method time) for the same prompt and "
        "repeat; decode-only speedup = the same over the time after the first token (prefill and time to first "
        "token left out); total-time speedup = sum of times / sum of times. With several repeats: median [min, max] "
        "over repeats. Formulas: docs/metrics.md.",
        "",
    ]


def cost_lines(results: dict) -> list[str]:
    """The cost per generated token, all prompts."""
    mem_kind = next((r["mem_kind"] for r in results["records"] if r.get("mem_kind")), None)
    header = COST_HEADER + [f"peak memory, {MEMORY_LABELS.get(mem_kind, 'memory')} (MiB)"]
    out = ["## Cost per generated token (all prompts)", ""]
    out += table(header, _cost_rows(results, results["summary"]["all"]))
    if mem_kind in ("process_peak_rss", "process_max_rss_growth"):
        out += [
            "",
            "Peak memory on CPU is process-wide (both models, the Python heap and every method that ran before), "
            "not the method's own.",
        ]
    return out + [""]


def category_lines(results: dict) -> list[str]:
    out = ["## Per category", ""]
    width = len(SPEED_HEADER)
    for key, summary in results["summary"]["categories"].items():
        n = len({r["prompt_id"] for r in results["records"] if category_key(r["dataset"], r["category"]) == key})
        out += [f"### {key} ({n} prompt{'s' if n != 1 else ''})", ""]
        out += table(SPEED_HEADER, [row[:width] for row in _speed_rows(results, summary, None)]) + [""]
    return out


def to_markdown(results: dict) -> str:
    exact = results["exactness"]
    out = header_lines(results) + ["## Headline (all prompts)", ""]
    out += table(
        SPEED_HEADER + (["same tokens as AR"] if exact is not None else []),
        _speed_rows(results, results["summary"]["all"], exact),
    )
    out += [""] + cost_lines(results)
    out += cost_curve_section(results)
    out += winners_section(results)
    out += ceiling_section(results)
    out += category_lines(results)
    out += exactness_section(results)
    out += oracle_section(results)
    if results["skipped"]:
        out += ["## Skipped prompts", ""] + [f"- `{s['id']}`: {s['reason']}" for s in results["skipped"]] + [""]
    out += [
        "## Files",
        "",
        "results.json (everything, raw records included), results.csv (one row per generation), "
        "records.jsonl (the resumable log),",
        "speedup.png, accepted_hist.png; with --spec-bench-jsonl, Spec-Bench's answer files (one per method).",
        "",
        "![speedup](speedup.png)",
        "",
        "![accepted tokens per step](accepted_hist.png)",
        "",
    ]
    return "\n".join(out)
