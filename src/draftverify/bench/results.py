"""results.json's content: a finished run's config, environment, raw records and their summaries."""

from __future__ import annotations

import dataclasses

from draftverify.bench import metrics
from draftverify.bench.datasets import category_key


def method_rows(specs) -> list[dict]:
    """What results.json says of each bench spec."""
    return [
        {
            "label": s.label,
            "name": s.name,
            "preset": s.preset,
            "options": dict(s.options),
            "peer": s.is_peer,
            "engine": s.engine,
            "gguf": s.gguf,
            "needs_draft": s.drafts.required,
            "warm": s.warm,
            "config": dataclasses.asdict(s.config),
        }
        for s in specs
    ]


def per_category(records: list[dict], table) -> dict:
    """`table(records)` over all records and over each category's."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(category_key(r["dataset"], r["category"]), []).append(r)
    return {"all": table(records), "categories": {k: table(v) for k, v in groups.items()}}


def assemble(bench, records: list[dict], oracles: list[dict], costs: dict, head: dict) -> dict:
    """results.json for `bench` (a runner.Bench): `head` holds command, config and environment."""
    baseline = bench.specs[0].label

    def oracle_for(recs):
        ids = {r["prompt_id"] for r in recs}
        if "draft" not in costs or not oracles:
            return None
        return metrics.oracle_table([o for o in oracles if o["prompt_id"] in ids], recs, baseline, costs)

    prompts = [
        {
            "id": p.id,
            "dataset": p.dataset,
            "category": p.category,
            "turn": p.turn,
            "prompt_tokens": len(bench.ids[p.id]),
        }
        for p in bench.prompts
        if p.id in bench.ids
    ]
    return {
        **head,
        "baseline": baseline,
        "greedy": bench.settings.greedy,
        "methods": method_rows(bench.specs),
        "prompts": prompts,
        "skipped": [{"id": k, "reason": v} for k, v in bench.skipped.items()],
        "cost_model": costs,
        "summary": per_category(records, lambda recs: metrics.summarize(recs, baseline)),
        "exactness": metrics.exactness(records, baseline) if bench.settings.greedy else None,
        "oracle": per_category(records, oracle_for),
        "ceiling": per_category(records, lambda recs: metrics.ceiling_table(recs, baseline, costs)),
        "oracles": oracles,
        "records": records,
    }
