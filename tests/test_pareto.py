"""`draftverify pareto`: the Pareto view (tokens/s against acceptance) of a bench run's results."""

from __future__ import annotations

import json

import pytest

# -- the Pareto view of a bench run ------------------------------------------------------------


def bench_record(label, prompt, dataset, wall, tokens, target, drafted, accepted):
    return {
        "label": label,
        "prompt_id": prompt,
        "repeat": 0,
        "dataset": dataset,
        "category": dataset,
        "wall_s": wall,
        "new_tokens": tokens,
        "target_forwards": target,
        "draft_forwards": drafted,
        "drafted": drafted,
        "accepted": accepted,
        "draft_s": 0.1,
        "verify_s": 0.1,
        "ttft_s": 0.1,
        "token_times": [0.1] * tokens,
        "steps": [],
        "peak_mem_bytes": 1,
    }


def test_pareto_view_of_a_bench_run(tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app
    from draftverify.tools.pareto import frontier, pareto_tables

    assert frontier([(1, 1), (2, 0.5), (2, 2), (0.5, 3), (1, 1)]) == [True, True, False, True, True]
    # (label, target forwards, drafted, accepted) for 10 tokens on each of two data sets
    methods = [
        ("autoregressive", 10, 0, 0),
        ("speculative[k=2]", 5, 10, 5),
        ("speculative[k=8]", 3, 24, 7),
        ("specdec-pp:h0.3", 4, 8, 6),
        ("specdec-pp[h=0.9,head=wrej3]", 3, 30, 7),
    ]
    records = [
        bench_record(label, f"{d}-1", d, 1.0, 10, t, dr, a)
        for d in ("humaneval", "spec_bench")
        for label, t, dr, a in methods
    ]
    results = {"baseline": "autoregressive", "methods": [{"label": m[0]} for m in methods], "records": records}
    tables = pareto_tables(results)
    assert set(tables) == {"all", "humaneval", "spec_bench"}
    rows = {r["label"]: r for r in tables["humaneval"]}
    assert "autoregressive" not in rows
    assert rows["speculative[k=2]"]["verification_rate"] == pytest.approx(0.5) and rows["speculative[k=2]"][
        "discard_rate"
    ] == pytest.approx(0.5)
    # specdec-pp h0.3 (0.4, 0.2) beats k=2 (0.5, 0.5); k=8 (0.3, 1.7) beats the wrej3 head's (0.3, 2.3)
    assert {label for label, r in rows.items() if r["frontier"]} == {"specdec-pp:h0.3", "speculative[k=8]"}
    assert (
        rows["specdec-pp[h=0.9,head=wrej3]"]["series"] == "specdec-pp[head=wrej3]"
        and rows["speculative[k=8]"]["series"] == "speculative"
    )
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    result = CliRunner().invoke(app, ["pareto", str(path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "pareto.png").stat().st_size > 0 and "| `specdec-pp:h0.3` | 0.400 | 0.200 |" in (
        tmp_path / "pareto.md"
    ).read_text()
    path.write_text('{"records": []}')
    assert "is not a bench results.json" in str(CliRunner().invoke(app, ["pareto", str(path)]).exception)
