"""The benchmark's metrics over its records (one record = one generation). docs/metrics.md
holds the same formulas with their reasons.

Sums run over the records of one method in one repeat (all prompts, or one category's):
- tokens_per_s              = sum new_tokens / sum wall_s
- speedup                   = geometric mean over prompts p of T_AR(p, r) / T_m(p, r)
                              (wall times of the same prompt in the same repeat r)
- total_speedup             = sum_p T_AR(p, r) / sum_p T_m(p, r)
- decode_speedup            = geometric mean over prompts p of D_AR(p, r) / D_m(p, r), where
                              D = wall_s - ttft_s, the time after the first token (prefill
                              and time to first token excluded); unknown when a TTFT is;
                              prompts with no time after the first token (one token) left out
- tokens_per_target_forward = sum new_tokens / sum target_forwards (prefill included; the
                              mean accepted tokens per target forward, bonus token included;
                              autoregressive = 1)
- acceptance_rate           = sum accepted / sum drafted
- target_forwards_per_token = sum target_forwards / sum new_tokens
- draft_forwards_per_token  = sum draft_forwards / sum new_tokens
- discarded_per_token       = sum (drafted - accepted) / sum new_tokens
- draft_s_per_drafted       = sum draft_s / sum drafted (what one drafted token costs to draft)
- draft_share, verify_share = sum draft_s / sum wall_s, sum verify_s / sum wall_s;
  other_share               = 1 - draft_share - verify_share
- ttft_p50_s                = median over prompts of the time to the first emitted token
- latency_p50_s, _p99_s     = percentiles (linear interpolation) of the gaps between
                              consecutive emitted tokens, pooled over the prompts; the
                              tokens of one accepted chunk share its time, so all but the
                              first of a chunk have a gap of 0
Each metric is computed per repeat; the report gives the median over repeats and the
spread [min, max]. A metric whose inputs are unknown (None) in any record is None
("unknown", never 0). peak_mem_bytes = max over the method's records.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from draftverify.bench.oracle import ceiling_times, chain_factor, oracle_rounds, oracle_times

METRICS = (
    "speedup",
    "total_speedup",
    "decode_speedup",
    "tokens_per_s",
    "tokens_per_target_forward",
    "acceptance_rate",
    "target_forwards_per_token",
    "draft_forwards_per_token",
    "discarded_per_token",
    "draft_s_per_drafted",
    "draft_share",
    "verify_share",
    "other_share",
    "ttft_p50_s",
    "latency_p50_s",
    "latency_p99_s",
)
CEILING_ACCEPTANCES = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # per-token acceptance of the ceiling table's rows
CEILING_DRAFT_COSTS = (0.0, 0.1, 0.3)  # its columns: drafting cost per drafted token, in target forwards
CEILING_TARGETS = (1.2, 1.5, 2.0)  # speedups whose needed acceptance the report gives


def _sum(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records]
    return None if any(v is None for v in values) else float(sum(values))


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def token_gaps(token_times: list[float]) -> list[float]:
    """Seconds between consecutive emitted tokens (0 inside an accepted chunk)."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


def decode_speedup(records: list[dict], baseline: dict[str, dict]) -> float | None:
    """Geometric mean over prompts of the baseline's time after its first token over the method's."""
    pairs = [(baseline[r["prompt_id"]], r) for r in records if r["prompt_id"] in baseline]
    if any(r["ttft_s"] is None for pair in pairs for r in pair):
        return None
    decode = [(b["wall_s"] - b["ttft_s"], m["wall_s"] - m["ttft_s"]) for b, m in pairs]
    return geomean([b / m for b, m in decode if b > 0 and m > 0])


def repeat_metrics(records: list[dict], baseline: dict[str, dict]) -> dict[str, float | None]:
    """The metrics of one method's records of one repeat; `baseline` maps prompt id ->
    the autoregressive record of the same prompt and repeat."""
    tokens, wall = _sum(records, "new_tokens"), _sum(records, "wall_s")
    pairs = [(baseline[r["prompt_id"]]["wall_s"], r["wall_s"]) for r in records if r["prompt_id"] in baseline]
    drafted, accepted = _sum(records, "drafted"), _sum(records, "accepted")
    draft_s, verify_s = _sum(records, "draft_s"), _sum(records, "verify_s")
    ttfts = [r["ttft_s"] for r in records]
    gaps = [g for r in records for g in token_gaps(r["token_times"])]
    draft_share, verify_share = _div(draft_s, wall), _div(verify_s, wall)
    return {
        "speedup": geomean([b / m for b, m in pairs if m > 0]),
        "total_speedup": _div(sum(b for b, _ in pairs), sum(m for _, m in pairs)) if pairs else None,
        "decode_speedup": decode_speedup(records, baseline),
        "tokens_per_s": _div(tokens, wall),
        "tokens_per_target_forward": _div(tokens, _sum(records, "target_forwards")),
        "acceptance_rate": _div(accepted, drafted),
        "target_forwards_per_token": _div(_sum(records, "target_forwards"), tokens),
        "draft_forwards_per_token": _div(_sum(records, "draft_forwards"), tokens),
        "discarded_per_token": _div(None if drafted is None or accepted is None else drafted - accepted, tokens),
        "draft_s_per_drafted": _div(draft_s, drafted),
        "draft_share": draft_share,
        "verify_share": verify_share,
        "other_share": None if draft_share is None or verify_share is None else 1 - draft_share - verify_share,
        "ttft_p50_s": None if any(t is None for t in ttfts) else percentile(ttfts, 50),
        "latency_p50_s": percentile(gaps, 50),
        "latency_p99_s": percentile(gaps, 99),
    }


def spread(values: list[float | None]) -> dict:
    """Median and [min, max] over repeats; None when any repeat's value is unknown."""
    if not values or any(v is None for v in values):
        return {"median": None, "min": None, "max": None, "n": len(values)}
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "n": len(values)}


def summarize(records: list[dict], baseline_label: str) -> dict[str, dict]:
    """label -> metric -> spread over repeats, plus peak_mem_bytes and the record count."""
    base: dict[int, dict[str, dict]] = defaultdict(dict)
    for r in records:
        if r["label"] == baseline_label:
            base[r["repeat"]][r["prompt_id"]] = r
    grouped: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        grouped[r["label"]][r["repeat"]].append(r)
    out = {}
    for label, by_repeat in grouped.items():
        per_repeat = [repeat_metrics(recs, base[repeat]) for repeat, recs in sorted(by_repeat.items())]
        out[label] = {name: spread([m[name] for m in per_repeat]) for name in METRICS}
        mems = [r.get("peak_mem_bytes") for recs in by_repeat.values() for r in recs]
        out[label]["peak_mem_bytes"] = None if any(m is None for m in mems) else max(mems)
        out[label]["records"] = sum(len(recs) for recs in by_repeat.values())
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def exactness(records: list[dict], baseline_label: str) -> dict[str, dict]:
    """label -> {compared: prompts, differ: prompts that differ in any repeat, cases: [...]}.

    Each method's tokens are compared with the autoregressive tokens of the same prompt and
    repeat; a case is (prompt_id, repeat, first divergence position).
    """
    base = {(r["prompt_id"], r["repeat"]): r["tokens"] for r in records if r["label"] == baseline_label}
    out: dict[str, dict] = {}
    for r in records:
        if r["label"] == baseline_label or (r["prompt_id"], r["repeat"]) not in base:
            continue
        entry = out.setdefault(r["label"], {"compared": set(), "differ": set(), "cases": []})
        entry["compared"].add(r["prompt_id"])
        position = first_divergence(base[(r["prompt_id"], r["repeat"])], r["tokens"])
        if position is not None:
            entry["differ"].add(r["prompt_id"])
            entry["cases"].append({"prompt_id": r["prompt_id"], "repeat": r["repeat"], "position": position})
    return {
        label: {"compared": len(e["compared"]), "differ": len(e["differ"]), "cases": e["cases"]}
        for label, e in out.items()
    }


def oracle_table(oracles: list[dict], records: list[dict], baseline_label: str, costs: dict) -> dict:
    """Per prompt oracle figures and their aggregate (geometric mean speedup, forwards per token).

    `oracles`: {prompt_id, n, disagreements, draft_prefill_s}; T_prefill of a prompt is the
    median time to first token of its autoregressive records.
    """
    ttft: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["label"] == baseline_label and r["ttft_s"] is not None:
            ttft[r["prompt_id"]].append(r["ttft_s"])
    rows = []
    for o in oracles:
        if o["prompt_id"] not in ttft:
            continue
        t_oracle, t_ar = oracle_times(
            o["n"], o["disagreements"], float(np.median(ttft[o["prompt_id"]])), o["draft_prefill_s"], costs
        )
        forwards = 1 + len(oracle_rounds(o["n"], o["disagreements"]))
        rows.append(
            {
                "prompt_id": o["prompt_id"],
                "n": o["n"],
                "target_forwards": forwards,
                "t_oracle_s": t_oracle,
                "t_ar_model_s": t_ar,
                "speedup": t_ar / t_oracle,
            }
        )
    return {
        "prompts": rows,
        "speedup": geomean([row["speedup"] for row in rows]),
        "target_forwards_per_token": _div(sum(r["target_forwards"] for r in rows), sum(r["n"] for r in rows))
        if rows
        else None,
    }


def ceiling_table(records: list[dict], baseline_label: str, costs: dict) -> dict | None:
    """What a chain drafter of a given per-token acceptance and drafting cost could reach on these prompts
    and this curve (oracle.py: `chain_factor`, `ceiling_times`), from the autoregressive records (per prompt
    the median over repeats of wall time and time to first token). None without a measured target curve.

    ceiling: speedup of a draft always right and free (acceptance 1, cost 0), the geometric mean over prompts;
    grid[c][a]: the same for acceptance a at cost c; needed[c][S]: the least acceptance (to 0.01) whose speedup
    reaches S at cost c, None where even acceptance 1 falls short."""
    curve = costs.get("target") if costs else None
    runs: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["label"] == baseline_label and r["ttft_s"] is not None and r["new_tokens"]:
            runs[r["prompt_id"]].append(r)
    if not curve or not runs:
        return None
    prompts = {
        pid: (
            rs[0]["new_tokens"],
            float(np.median([r["ttft_s"] for r in rs])),
            float(np.median([r["wall_s"] for r in rs])),
        )
        for pid, rs in runs.items()
    }

    def speedup(acceptance: float, cost: float) -> float:
        factor = chain_factor(curve, acceptance, cost)
        return geomean([wall / ceiling_times(n, first, wall, factor) for n, first, wall in prompts.values()])

    def needed(target: float, cost: float) -> float | None:
        if speedup(1.0, cost) < target:
            return None
        return next(a / 100 for a in range(101) if speedup(a / 100, cost) >= target)

    full = chain_factor(curve, 1.0, 0.0)
    return {
        "prompts": [
            {"prompt_id": pid, "prefill_share": first / wall, "ceiling": wall / ceiling_times(n, first, wall, full)}
            for pid, (n, first, wall) in prompts.items()
        ],
        "ceiling": speedup(1.0, 0.0),
        "prefill_share": float(np.mean([first / wall for _, first, wall in prompts.values()])),
        "grid": {c: {a: speedup(a, c) for a in CEILING_ACCEPTANCES} for c in CEILING_DRAFT_COSTS},
        "needed": {c: {t: needed(t, c) for t in CEILING_TARGETS} for c in CEILING_DRAFT_COSTS},
    }
