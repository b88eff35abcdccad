"""The report's analysis sections: winners, the ceiling, the forward cost curves, exactness, the oracle."""

from __future__ import annotations

from draftverify.bench.cells import cell, table


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
            "Oracle pick: the fastest single draftverify method of this run (autoregressive included) on those "
            "prompts, chosen after the fact; `auto` / oracle pick is how close `auto`, choosing as it goes, came to it."
        )
    return ["## Winners", ""] + notes + [""] + table(header, rows) + [""]


def ceiling_section(results: dict) -> list[str]:
    """What a chain drafter of each per-token acceptance and drafting cost could reach here (metrics.ceiling_table)."""
    grid = (results.get("ceiling") or {}).get("all")
    if grid is None:
        return []
    costs = list(grid["grid"])

    def cost_name(c: float) -> str:
        return "free" if c == 0 else f"{c:g}x a target forward"

    out = [
        "## The ceiling here: what any drafter could reach",
        "",
        "Every lossless method still runs the prompt's forward and verifies each token with the target. "
        "On this run's cost curve, a round of k drafted tokens, each accepted with probability a and drafted at "
        "c target forwards a token, costs t(k + 1) / t(1) + k c target steps for 1 + a + ... + a^k tokens. "
        "At the best k (none where nothing pays), with each prompt's own time to first token and step time from "
        "its autoregressive run, the speedup over all prompts (geometric mean) is below; the prompt's forward is "
        f"{grid['prefill_share']:.0%} of autoregressive decoding's time on average here, and a draft always right "
        f"and free reaches **{grid['ceiling']:.2f}x** (per category: the Winners table). Formulas: docs/metrics.md.",
        "",
    ]
    rows = [[f"{a:.1f}", *(f"{grid['grid'][c][a]:.2f}x" for c in costs)] for a in next(iter(grid["grid"].values()))]
    out += table(["per-token acceptance", *(f"drafting {cost_name(c)}" for c in costs)], rows) + [""]
    targets = list(next(iter(grid["needed"].values())))
    rows = [
        [
            cost_name(c),
            *("beyond reach" if grid["needed"][c][t] is None else f"{grid['needed'][c][t]:.2f}" for t in targets),
        ]
        for c in costs
    ]
    out += ["Per-token acceptance needed for a speedup:", ""]
    out += table(["drafting cost per drafted token", *(f"{t:g}x" for t in targets)], rows) + [""]
    return out


LLAMACPP_CURVES = (  # the cost model's key, and the GGUF llama.cpp ran there
    ("llamacpp", "the target's own file"),
    ("llamacpp-f32", "F32 re-export"),
)


def cost_curve_section(results: dict) -> list[str]:
    """The measured forward times per new-token count: the path in use, the draft, and llama.cpp on each GGUF."""
    costs = results["cost_model"]
    if not costs or "target" not in costs:
        return []
    widths = list(costs["target"])
    t1 = costs["target"][widths[0]]
    out = [
        "## Forward cost curve",
        "",
        f"One forward of w new tokens after {costs['context_tokens']} tokens of context, fastest of 5 runs, the "
        "widths in turn (target and llama.cpp: logits for every new token, as when verifying a draft; draft: for the "
        "last one)." + (f" Forward path: {costs['backend']}." if costs.get("backend") else ""),
        "",
    ]
    rows = [
        ["target forward (ms)", *(f"{t * 1000:.1f}" for t in costs["target"].values())],
        ["target t(w) / t(1)", *(f"{t / t1:.2f}" for t in costs["target"].values())],
    ]
    if "draft" in costs:
        rows.append(["draft forward (ms)", *(f"{t * 1000:.1f}" for t in costs["draft"].values())])
    for key, what in LLAMACPP_CURVES:
        ref = costs.get(key)
        if ref is None:
            continue
        rows.append([f"llama.cpp forward, {what} (ms)", *(f"{ref[w] * 1000:.1f}" if w in ref else "-" for w in widths)])
        ratios = (f"{costs['target'][w] / ref[w]:.2f}" if w in ref else "-" for w in widths)
        rows.append([f"target / llama.cpp, {what}", *ratios])
    return out + table(["new tokens per forward", *map(str, widths)], rows) + [""]


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
            f"llama.cpp ({', '.join(f'`{x}`' for x in sorted(other_kernels))}) runs the same weights with its own "
            "kernels (on the target's own file, its own block arithmetic), which round differently: where two tokens",
            "nearly tie its greedy choice may differ. Those rows measure speed, not exactness.",
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
    return out + table(["method", "prompts compared", "prompts that differ", "first divergence"], rows) + [""]


def oracle_section(results: dict) -> list[str]:
    out = ["## How far from the limit (SpecDec++ oracle)", ""]
    oracle, costs = results["oracle"]["all"], results["cost_model"]
    if oracle is None:
        return out + ["No draft model in this run: the oracle does not apply.", ""]
    out += [
        "The draft teacher-forced over each prompt's autoregressive output: with hindsight a drafter stops before",
        "every disagreement, so the target runs one forward per disagreement plus one. Its time comes from a cost",
        f"model of forward times measured at the start of the run (after {costs['context_tokens']} tokens of context);",
        "see docs/metrics.md.",
        "",
    ]
    out += table(
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
                cell(s["speedup"], ".2f", m["peer"], unit="x"),
                f"{oracle['speedup']:.2f}x" if uses else "n/a",
                cell(s["target_forwards_per_token"], ".3f", m["peer"]),
                f"{oracle['target_forwards_per_token']:.3f}" if uses else "n/a",
            ]
        )
    out += table(
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
    out += table(["category", "oracle speedup", "oracle target forwards/token"], cat_rows) + [""]
    return out
