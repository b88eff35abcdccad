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

from draftverify.bench.datasets import category_key
from draftverify.bench.metrics import first_divergence
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


def _fmt(value, spec: str, unknown: bool) -> str:
    return ("unknown" if unknown else "n/a") if value is None else format(value, spec)


def _cell(metric: dict, spec: str, unknown: bool, scale: float = 1.0, unit: str = "") -> str:
    """'1.23x' or, over several repeats that disagree, '1.23x [1.20, 1.25]'."""
    if metric["median"] is None:
        return _fmt(None, spec, unknown)
    text = format(metric["median"] * scale, spec) + unit
    if metric["n"] > 1 and metric["min"] != metric["max"]:
        text += f" [{format(metric['min'] * scale, spec)}, {format(metric['max'] * scale, spec)}]"
    return text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _speed_rows(results: dict, summary: dict, exact: dict | None) -> list[list[str]]:
    rows = []
    for m in results["methods"]:
        s = summary.get(m["label"])
        if s is None:
            continue
        peer = m["peer"]
        cells = [
            f"`{m['label']}`",
            _cell(s["speedup"], ".2f", peer, unit="x"),
            _cell(s["total_speedup"], ".2f", peer, unit="x"),
            _cell(s["tokens_per_s"], ".1f", peer),
            _cell(s["tokens_per_target_forward"], ".2f", peer),
            _cell(s["acceptance_rate"], ".2f", peer),
        ]
        if exact is not None:
            e = exact.get(m["label"])
            cells.append(
                "baseline"
                if m["label"] == results["baseline"]
                else "n/a"
                if e is None
                else "yes"
                if not e["differ"]
                else f"**NO ({e['differ']})**"
            )
        rows.append(cells)
    return rows


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
                _cell(s["target_forwards_per_token"], ".3f", peer),
                _cell(s["draft_forwards_per_token"], ".3f", peer),
                _cell(s["discarded_per_token"], ".3f", peer),
                _per_drafted(s.get("draft_s_per_drafted"), t1),
                split_text,
                _cell(s["ttft_p50_s"], ".1f", peer, scale=1000),
                _cell(s["latency_p50_s"], ".1f", peer, scale=1000)
                + " / "
                + _cell(s["latency_p99_s"], ".1f", peer, scale=1000),
                "unknown" if mem is None else f"{mem / 2**20:.0f}",
            ]
        )
    return rows


def _per_drafted(spread: dict | None, t1: float | None) -> str:
    if spread is None or spread["median"] is None:
        return "-"
    ms = spread["median"] * 1000
    return f"{ms:.2f}" + (f" ({spread['median'] / t1:.3f}x)" if t1 else "")


def to_markdown(results: dict) -> str:
    cfg, env = results["config"], results["environment"]
    exact = results["exactness"]
    sampling = (
        "greedy"
        if results["greedy"]
        else f"sampling (temperature {cfg['temperature']}, top-k {cfg['top_k']}, top-p {cfg['top_p']}, seed {cfg['seed']})"
    )
    hardware = env["gpu"] or env["cpu"] or env["platform"]
    mem_kind = next((r["mem_kind"] for r in results["records"] if r.get("mem_kind")), None)
    out = [
        f"# draftverify bench: {cfg['target']}",
        "",
        "```",
        results["command"] or "(run from Python)",
        "```",
        "",
        f"- target `{cfg['target']}`, draft `{cfg['draft'] or 'none'}`"
        + (f", feature head `{cfg['head']}`" if cfg.get("head") else "")
        + ", "
        f"{cfg['dtype'].replace('torch.', '')} on {env['device']} ({hardware}), "
        f"{env['torch_threads']} threads; torch {env['torch']}, transformers {env['transformers']}, draftverify {env['draftverify']}"
        + (f" ({env['git_commit']})" if env.get("git_commit") else ""),
        f"- {len(results['prompts'])} prompts ({len(results['skipped'])} skipped), {cfg['max_new_tokens']} new tokens at most, "
        f"{cfg['repeats']} repeat(s), {sampling}; methods interleaved prompt by prompt after a warm-up",
        "- speedup = geometric mean over prompts of (autoregressive time / method time) for the same prompt and repeat; "
        "total-time speedup = sum of times / sum of times. With several repeats: median [min, max] over repeats. "
        "Formulas: docs/metrics.md.",
        "",
        "## Headline (all prompts)",
        "",
    ]
    header = ["method", "speedup", "total-time speedup", "tokens/s", "tokens per target forward", "acceptance rate"]
    out += _table(
        header + (["same tokens as AR"] if exact is not None else []),
        _speed_rows(results, results["summary"]["all"], exact),
    )
    out += ["", "## Cost per generated token (all prompts)", ""]
    mem_label = {
        "cuda_max_allocated": "CUDA max allocated",
        "process_peak_rss": "process peak RSS",
        "process_max_rss_growth": "process max-RSS growth",
    }.get(mem_kind, "memory")
    out += _table(
        [
            "method",
            "target forwards/token",
            "draft forwards/token",
            "discarded/token",
            "draft time per drafted token (ms, x target forward)",
            "time draft / verify / other",
            "TTFT p50 (ms)",
            "per-token latency p50 / p99 (ms)",
            f"peak memory, {mem_label} (MiB)",
        ],
        _cost_rows(results, results["summary"]["all"]),
    )
    if mem_kind in ("process_peak_rss", "process_max_rss_growth"):
        out += [
            "",
            "Peak memory on CPU is process-wide (both models, the Python heap and every method that ran before), not the method's own.",
        ]
    out += [""] + cost_curve_section(results)
    out += winners_section(results)
    out += ceiling_section(results)
    out += ["## Per category", ""]
    for key, summary in results["summary"]["categories"].items():
        n = len({r["prompt_id"] for r in results["records"] if category_key(r["dataset"], r["category"]) == key})
        out += [f"### {key} ({n} prompt{'s' if n != 1 else ''})", ""]
        out += _table(header, [row[:6] for row in _speed_rows(results, summary, None)]) + [""]
    out += exactness_section(results)
    out += oracle_section(results)
    if results["skipped"]:
        out += ["## Skipped prompts", ""] + [f"- `{s['id']}`: {s['reason']}" for s in results["skipped"]] + [""]
    out += [
        "## Files",
        "",
        "results.json (everything, raw records included), results.csv (one row per generation), records.jsonl (the resumable log),",
        "speedup.png, accepted_hist.png.",
        "",
        "![speedup](speedup.png)",
        "",
        "![accepted tokens per step](accepted_hist.png)",
        "",
    ]
    return "\n".join(out)


def winners_section(results: dict) -> list[str]:
    """Per category: the fastest method, the fastest of draftverify's own, and which of ours lose to AR."""
    ours = [m["label"] for m in results["methods"] if not m["peer"] and m["label"] != results["baseline"]]
    if not ours:
        return []

    def speedup(summary: dict, label: str) -> float | None:
        return summary.get(label, {}).get("speedup", {}).get("median")

    def best(summary: dict, labels: list[str]) -> str:
        scored = [(speedup(summary, label), label) for label in labels if speedup(summary, label) is not None]
        if not scored:
            return "n/a"
        value, label = max(scored)
        return f"`{label}` {value:.2f}x"

    everyone = [m["label"] for m in results["methods"]]
    autos = [m["label"] for m in results["methods"] if m["name"] == "auto"]
    singles = [results["baseline"]] + [
        label for label in ours if label not in autos
    ]  # what auto chooses among, AR included
    rows = []
    ceilings = results.get("ceiling") or {}
    ceiling = {"all prompts": ceilings.get("all"), **ceilings.get("categories", {})}
    for key, summary in [("all prompts", results["summary"]["all"])] + list(results["summary"]["categories"].items()):
        losers = [label for label in ours if (speedup(summary, label) or 1.0) < 1.0]
        row = [key, best(summary, everyone), best(summary, ours), ", ".join(f"`{label}`" for label in losers) or "none"]
        if ceilings:
            row.append(f"{ceiling[key]['ceiling']:.2f}x" if ceiling.get(key) else "n/a")
        for label in autos:
            scored = [(speedup(summary, s) if s != results["baseline"] else 1.0, s) for s in singles]
            value, pick = max((v, s) for v, s in scored if v is not None)
            mine = speedup(summary, label)
            row.append("n/a" if mine is None else f"{mine / value:.2f} (`{pick}` {value:.2f}x)")
        rows.append(row)
    header = [
        "prompts",
        "fastest (any)",
        "fastest of draftverify's methods",
        "draftverify methods slower than autoregressive",
    ]
    notes = ["Speedup over autoregressive decoding; a method below 1.00x is slower than plain decoding there."]
    if ceilings:
        header.append("ceiling: a draft always right and free")
        notes.append(
            "Ceiling: the most any lossless drafter could reach on those prompts on this machine (next section)."
        )
    if autos:
        header += [f"`{label}` / oracle pick" for label in autos]
        notes.append(
            "Oracle pick: the fastest single draftverify method of this run (autoregressive included) on those prompts, "
            "chosen after the fact; `auto` / oracle pick is how close `auto`, choosing as it goes, came to it."
        )
    return ["## Winners", ""] + notes + [""] + _table(header, rows) + [""]


def ceiling_section(results: dict) -> list[str]:
    """What a chain drafter of each per-token acceptance and drafting cost could reach here (metrics.ceiling_table)."""
    table = (results.get("ceiling") or {}).get("all")
    if table is None:
        return []
    costs = list(table["grid"])

    def cost_name(c: float) -> str:
        return "free" if c == 0 else f"{c:g}x a target forward"

    out = [
        "## The ceiling here: what any drafter could reach",
        "",
        "Every lossless method still runs the prompt's forward and verifies each token with the target. On this run's cost curve,",
        "a round of k drafted tokens, each accepted with probability a and drafted at c target forwards a token, costs",
        "t(k + 1) / t(1) + k c target steps for 1 + a + ... + a^k tokens. At the best k (none where nothing pays), with each",
        "prompt's own time to first token and step time from its autoregressive run, the speedup over all prompts (geometric",
        f"mean) is below; the prompt's forward is {table['prefill_share']:.0%} of autoregressive decoding's time on average here, and",
        f"a draft always right and free reaches **{table['ceiling']:.2f}x** (per category: the Winners table). Formulas: docs/metrics.md.",
        "",
    ]
    rows = [[f"{a:.1f}", *(f"{table['grid'][c][a]:.2f}x" for c in costs)] for a in next(iter(table["grid"].values()))]
    out += _table(["per-token acceptance", *(f"drafting {cost_name(c)}" for c in costs)], rows) + [""]
    targets = list(next(iter(table["needed"].values())))
    rows = [
        [
            cost_name(c),
            *("beyond reach" if table["needed"][c][t] is None else f"{table['needed'][c][t]:.2f}" for t in targets),
        ]
        for c in costs
    ]
    out += ["Per-token acceptance needed for a speedup:", ""]
    out += _table(["drafting cost per drafted token", *(f"{t:g}x" for t in targets)], rows) + [""]
    return out


def cost_curve_section(results: dict) -> list[str]:
    """The measured forward times per new-token count: the path in use, the draft, and llama.cpp."""
    costs = results["cost_model"]
    if not costs or "target" not in costs:
        return []
    widths = list(costs["target"])
    t1 = costs["target"][widths[0]]
    out = [
        "## Forward cost curve",
        "",
        f"One forward of w new tokens after {costs['context_tokens']} tokens of context, fastest of 5 runs (target and llama.cpp:",
        "logits for every new token, as when verifying a draft; draft: for the last one)."
        + (f" Forward path: {costs['backend']}." if costs.get("backend") else ""),
        "",
    ]
    rows = [
        ["target forward (ms)", *(f"{t * 1000:.1f}" for t in costs["target"].values())],
        ["target t(w) / t(1)", *(f"{t / t1:.2f}" for t in costs["target"].values())],
    ]
    if "draft" in costs:
        rows.append(["draft forward (ms)", *(f"{t * 1000:.1f}" for t in costs["draft"].values())])
    if "llamacpp" in costs:
        ref = costs["llamacpp"]
        rows.append(["llama.cpp forward (ms)", *(f"{ref[w] * 1000:.1f}" if w in ref else "-" for w in widths)])
        rows.append(
            ["target / llama.cpp", *(f"{costs['target'][w] / ref[w]:.2f}" if w in ref else "-" for w in widths)]
        )
    return out + _table(["new tokens per forward", *map(str, widths)], rows) + [""]


def exactness_section(results: dict) -> list[str]:
    out = ["## Exactness", ""]
    exact = results["exactness"]
    if exact is None:
        return out + [
            "Sampling run: outputs differ from autoregressive decoding by design. Exactness of the sampled",
            "distribution is checked statistically by the test suite.",
            "",
        ]
    other_kernels = {m["label"] for m in results["methods"] if m.get("engine") == "llama.cpp"}
    failing = {label: e for label, e in exact.items() if e["differ"] and label not in other_kernels}
    if other_kernels:
        out += [
            f"llama.cpp ({', '.join(f'`{x}`' for x in sorted(other_kernels))}) runs the same weights with its own kernels, which round",
            "differently: where two tokens nearly tie its greedy choice may differ. Those rows measure speed, not exactness.",
            "",
        ]
    if failing:
        names = ", ".join(f"`{label}` ({e['differ']} prompts)" for label, e in failing.items())
        out += [
            f"**RED FLAG: output differs from autoregressive decoding for {names}.** Expected: no difference in fp32.",
            "",
        ]
    else:
        out += ["Every method produced exactly the autoregressive tokens on every prompt and repeat.", ""]
    rows = []
    for label, e in exact.items():
        first = ", ".join(f"{c['prompt_id']} (repeat {c['repeat']}): token {c['position']}" for c in e["cases"][:5])
        rows.append(
            [f"`{label}`", str(e["compared"]), str(e["differ"]), first + (" ..." if len(e["cases"]) > 5 else "") or "-"]
        )
    return out + _table(["method", "prompts compared", "prompts that differ", "first divergence"], rows) + [""]


def oracle_section(results: dict) -> list[str]:
    out = ["## How far from the limit (SpecDec++ oracle)", ""]
    oracle, costs = results["oracle"]["all"], results["cost_model"]
    if oracle is None:
        return out + ["No draft model in this run: the oracle does not apply.", ""]
    out += [
        "The draft teacher-forced over each prompt's autoregressive output: with hindsight a drafter stops before every",
        "disagreement, so the target runs one forward per disagreement plus one. Its time comes from a cost model of",
        f"forward times measured at the start of the run (after {costs['context_tokens']} tokens of context); see docs/metrics.md.",
        "",
    ]
    out += _table(
        ["new tokens per forward", *map(str, costs["target"])],
        [
            ["target forward (ms)", *(f"{t * 1000:.1f}" for t in costs["target"].values())],
            ["draft forward (ms)", *(f"{t * 1000:.1f}" for t in costs["draft"].values())],
        ],
    ) + [""]
    summary = results["summary"]["all"]
    rows = []
    for m in results["methods"]:
        s = summary[m["label"]]
        uses = m["needs_draft"]
        rows.append(
            [
                f"`{m['label']}`",
                _cell(s["speedup"], ".2f", m["peer"], unit="x"),
                f"{oracle['speedup']:.2f}x" if uses else "n/a",
                _cell(s["target_forwards_per_token"], ".3f", m["peer"]),
                f"{oracle['target_forwards_per_token']:.3f}" if uses else "n/a",
            ]
        )
    out += _table(
        [
            "method",
            "achieved speedup",
            "oracle speedup (cost model)",
            "target forwards/token",
            "oracle target forwards/token",
        ],
        rows,
    ) + [""]
    cat_rows = [
        [key, f"{o['speedup']:.2f}x", f"{o['target_forwards_per_token']:.3f}"]
        for key, o in results["oracle"]["categories"].items()
        if o is not None and o["prompts"]
    ]
    out += _table(["category", "oracle speedup", "oracle target forwards/token"], cat_rows) + [""]
    return out
