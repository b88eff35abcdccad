"""`draftverify load`: a spawned server under concurrent clients, the numbers it reports, loopback only."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from draftverify.cli import app
from draftverify.errors import DraftVerifyError
from draftverify.serve.load import Call, Run, check_loopback, count_mismatches, percentile


def test_percentiles_and_mismatches():
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0

    def run(method, c, texts):
        return Run(
            method,
            c,
            len(texts),
            0,
            1.0,
            1.0,
            None,
            None,
            None,
            None,
            calls=[Call(i, True, text=t) for i, t in enumerate(texts)],
        )

    runs = [run("a", 1, ["x", "y"]), run("a", 8, ["x", "z"]), run("b", 1, ["x", "y"]), run("b", 8, ["q", "y"])]
    count_mismatches(runs)
    assert [r.mismatches for r in runs] == [0, 1, 0, 1]  # b's first run is checked against a's


def test_traffic_stays_on_loopback():
    assert check_loopback("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    with pytest.raises(DraftVerifyError, match="not on loopback"):
        check_loopback("http://example.com/v1")


def test_spawned_load_run(tiny, tmp_path):
    try:
        from draftverify.bench.datasets import resolve_data_dir

        data = resolve_data_dir(None)
    except DraftVerifyError:
        pytest.skip("the shared benchmark data folder is not on this machine")
    target = tiny("llama", layers=2)
    target.model.save_pretrained(tmp_path / "t")
    target.tokenizer.save_pretrained(tmp_path / "t")
    out = tmp_path / "load"
    result = CliRunner().invoke(
        app,
        [
            "load",
            "--spawn",
            "--target",
            str(tmp_path / "t"),
            "--draft",
            "self:layers=1",
            "--methods",
            "autoregressive,auto",
            "--concurrency",
            "1,3",
            "--requests",
            "6",
            "--max-tokens",
            "8",
            "--datasets",
            "mt_bench,gsm8k",
            "--data-dir",
            str(data),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output + (out / "server.log").read_text()
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert [(r["method"], r["concurrency"]) for r in runs] == [
        ("autoregressive", 1),
        ("autoregressive", 3),
        ("auto", 1),
        ("auto", 3),
    ]
    for r in runs:
        assert r["requests"] == 6 and r["errors"] == 0 and r["mismatches"] == 0, r
        assert (
            r["tokens_per_s"] > 0 and r["latency_p50_s"] <= r["latency_p99_s"] and r["ttft_p50_s"] <= r["latency_p99_s"]
        )
        assert all(c["tokens"] >= 1 for c in r["calls"])
    assert "| `auto` | 3 | 6 | 0 |" in (out / "report.md").read_text() and (out / "tokens_per_s.png").stat().st_size > 0
    bad = CliRunner().invoke(
        app, ["load", "--url", "http://example.com/v1", "--out", str(tmp_path / "x"), "--data-dir", str(data)]
    )
    assert bad.exit_code != 0 and "not on loopback" in str(bad.exception)
