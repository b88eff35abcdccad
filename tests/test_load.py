"""`draftverify load`: a spawned server under concurrent clients, the numbers it reports, loopback only; with
`--response-format`, every request carries the format and each JSON output is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_constraints import FORMAT
from test_serve import WAIT_S, serving, url_of
from typer.testing import CliRunner

from draftverify import Engine
from draftverify.cli import app
from draftverify.errors import DraftVerifyError
from draftverify.serve.load import Ask, Call, Run, check_loopback, count_mismatches, load, percentile
from draftverify.serve.load_format import describe, output_valid, read_response_format
from draftverify.serve.load_report import report


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
        # the waits between pieces of streamed text: the run's p99 and longest, each call's longest, not every wait
        longest = [c["gap_max_s"] for c in r["calls"] if c["gap_max_s"] is not None]
        assert longest and 0 < r["gap_p99_s"] <= r["gap_max_s"] == max(longest) <= r["latency_p99_s"]
        assert all("gaps" not in c for c in r["calls"])
    assert "| `auto` | 3 | 6 | 0 |" in (out / "report.md").read_text() and (out / "tokens_per_s.png").stat().st_size > 0
    bad = CliRunner().invoke(
        app, ["load", "--url", "http://example.com/v1", "--out", str(tmp_path / "x"), "--data-dir", str(data)]
    )
    assert bad.exit_code != 0 and "not on loopback" in str(bad.exception)


def test_outputs_are_checked_against_the_json_format():
    good = '{"name":"Ann","age":31,"color":"red","tags":["a"]}'
    assert output_valid(good, FORMAT) is True
    assert output_valid('{"name":"Ann","age":"31","color":"red","tags":["a"]}', FORMAT) is False  # a string age
    assert output_valid('{"name":"Ann","age":31,"color":"pink","tags":[]}', FORMAT) is False  # not in the enum
    assert output_valid(good[:-5], FORMAT) is False  # cut at the token limit: does not parse
    assert output_valid("[1]", {"type": "json_object"}) is False and output_valid("{}", {"type": "json_object"})
    assert output_valid("anything", None) is None and output_valid("x", {"type": "regex", "regex": "x"}) is None


def test_bad_response_format_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "broken.json").write_text('{"type": ')
    (tmp_path / "noschema.json").write_text('{"type": "json_schema", "json_schema": {"name": "x"}}')
    for name, problem in [("missing.json", "cannot read"), ("broken.json", "cannot read"), ("noschema.json", "schema")]:
        result = CliRunner().invoke(
            app, ["load", "--url", "http://127.0.0.1:9/v1", "--response-format", str(tmp_path / name)]
        )
        message = str(result.exception)
        assert result.exit_code != 0 and isinstance(result.exception, DraftVerifyError), result.output
        assert name in message and problem in message and "give a JSON file" in message and "\n" not in message
    example = read_response_format(Path(__file__).parents[1] / "docs/examples/word-problem.json")
    assert describe(example) == "json_schema `word_problem`"
    schema = example["json_schema"]["schema"]
    assert set(schema["required"]) == set(schema["properties"]) and schema["additionalProperties"] is False


def test_the_request_carries_the_format_and_system_message():
    body = Ask(16, 10.0, FORMAT, "Answer in JSON").body("m", "auto", "A person")
    assert body["response_format"] == FORMAT and body["messages"][0] == {"role": "system", "content": "Answer in JSON"}
    plain = Ask(16, 10.0).body("m", "auto", "A person")
    assert "response_format" not in plain and plain["messages"] == [{"role": "user", "content": "A person"}]


def test_load_with_a_json_schema_against_a_live_server(tiny):
    engine = Engine(tiny("llama"), tiny("llama", seed=1, layers=2))
    prompts = ["A person", "Someone else"]
    with serving(engine, "speculative[k=4],autoregressive") as (client, _):
        base = f"{url_of(client)}/v1"

        def run(ask):
            methods = ["speculative[k=4]", "autoregressive"]
            return load(base, methods, [1], prompts, 2, ask, WAIT_S, "test", "", "test", "person.json", log=lambda m: 0)

        results = run(Ask(100, WAIT_S, FORMAT))
        cut = run(Ask(3, WAIT_S, FORMAT))  # three tokens cannot close the object
        plain = run(Ask(8, WAIT_S))
    runs = results["runs"]
    assert [(r["errors"], r["invalid"], r["mismatches"]) for r in runs] == [(0, 0, 0), (0, 0, 0)]
    want = engine.generate([{"role": "user", "content": "A person"}], method="autoregressive", max_new_tokens=100,
                           response_format=FORMAT)  # fmt: skip
    assert [c["text"] for c in runs[1]["calls"] if c["prompt"] == 0] == [want.text]
    assert all(c["valid"] is True for r in runs for c in r["calls"])
    assert [r["invalid"] for r in cut["runs"]] == [2, 2]
    assert [r["invalid"] for r in plain["runs"]] == [None, None]
    settings = results["settings"]
    assert settings["response_format_file"] == "person.json" and settings["response_format"] == FORMAT
    text = report(results)
    assert "`person.json` (json_schema `person`)" in text and "| 0 | 0 |" in text
    assert "- `autoregressive` / `speculative[k=4]` at 1 client: " in text
    assert "| - |" in report(plain)


def test_report_gives_each_later_method_against_the_first_at_each_concurrency():
    def run(method, c, tps):
        return dict(
            method=method, concurrency=c, requests=8, errors=0, tokens_per_s=tps, latency_p50_s=1.0,
            latency_p99_s=2.0, ttft_p50_s=0.1, ttft_p99_s=0.2, mismatches=0, invalid=1, calls=[],
        )  # fmt: skip

    settings = dict(requests=8, max_tokens=256, concurrency=[1, 8], methods=["auto", "autoregressive"], prompts="g")
    results = dict(command="", server="s", model="m", settings=settings)
    results["runs"] = [run("auto", 1, 30.0), run("auto", 8, 80.0), run("autoregressive", 1, 20.0)]
    results["runs"].append(run("autoregressive", 8, 100.0))
    text = report(results)
    assert "- `autoregressive` / `auto` at 1 client: 0.67x tokens/s" in text
    assert "- `autoregressive` / `auto` at 8 clients: 1.25x tokens/s" in text
    assert "| `auto` | 8 | 8 | 0 | 80.0 | 2.67x |" in text and text.count("| 0 | 1 |") == 4
    results["runs"] = results["runs"][:2]
    assert " / `auto` at" not in report(results)  # one method: no ratio
