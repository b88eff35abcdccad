"""`python -m draftverify.bench.digest`: one row per bench report, read from its results.json."""

import json

import pytest

from draftverify.bench.digest import digest, main


def report(folder, arithmetic="q8", differ=0):
    folder.mkdir(parents=True)
    stat = lambda v: {"median": v, "min": v, "max": v, "n": 1}  # noqa: E731
    results = {
        "config": {"target": "/x/model.Q4_K_M.gguf", "arithmetic": arithmetic, "methods": ["autoregressive", "auto"]},
        "baseline": "autoregressive",
        "summary": {"all": {
            "autoregressive": {"tokens_per_s": stat(120.0), "speedup": stat(1.0), "ttft_p50_s": stat(0.1)},
            "auto": {"speedup": stat(1.25), "decode_speedup": stat(1.3)},
        }},
        "exactness": {"auto": {"compared": 8, "differ": differ}},
        "cost_model": {"target": {"1": 0.005, "8": 0.009}, "llamacpp": {"1": 0.0075}},
    }  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_a_row_per_report_with_its_link(tmp_path):
    a, b = report(tmp_path / "runs" / "a"), report(tmp_path / "runs" / "b", "fp32", differ=2)
    text = digest([a, b], tmp_path / "runs" / "latest.md", "cmd")
    assert (tmp_path / "runs" / "latest.md").read_text() == text
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert rows[0].startswith("| [a](a/report.md) | `model.Q4_K_M.gguf` | q8 | 120.0 | `auto` 1.25x / 1.30x |")
    assert "5.0 / 7.5 (1.50x) | 1.80 | 100 |" in rows[0]
    assert "| fp32 |" in rows[1] and "(2 differ)" in rows[1]
    assert text.startswith("# Latest bench reports at a glance\n")
    main([str(a), "--out", str(tmp_path / "t.md"), "--title", "Before and after"])
    assert (tmp_path / "t.md").read_text().startswith("# Before and after\n")


def test_a_folder_without_results_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="not a bench report"):
        main([str(tmp_path), "--out", str(tmp_path / "x.md")])


def test_readme_block_is_rewritten_from_the_reports(tmp_path):
    a = report(tmp_path / "docs" / "benchmarks" / "a", differ=1)
    page = tmp_path / "README.md"
    page.write_text("# x\n\nbefore\n<!-- results:begin -->\nstale 9.99x\n<!-- results:end -->\nafter\n")
    main([str(a), "--readme", str(page)])
    text = page.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- results:begin: written by `python -m draftverify.bench.digest ")
    assert text.endswith("<!-- results:end -->\nafter\n") and "stale" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    link = "(docs/benchmarks/a/report.md)"
    assert rows[0] == f"| `autoregressive` | [120.0]{link} | [1.00x]{link} | [1.00x]{link} | baseline |"
    assert rows[1] == f"| `auto` | - | [1.25x]{link} | [1.30x]{link} | 1 of 8 prompts differ |"
    assert "**[a](docs/benchmarks/a/report.md): `model.Q4_K_M.gguf`, q8," in text
    main([str(a), "--readme", str(page)])  # idempotent: the block is replaced, not added to
    assert page.read_text() == text


def test_readme_without_markers_is_one_line(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# x\n")
    with pytest.raises(SystemExit, match="no '<!-- results:begin -->'"):
        main([str(report(tmp_path / "a")), "--readme", str(page)])
    assert page.read_text() == "# x\n"
