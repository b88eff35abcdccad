"""`python -m draftverify.bench.first_request`: a fresh process's first request against its later ones."""

import pytest

from draftverify.bench.first_request import main, report, unseen_cache


def test_the_report_rows_are_the_processes_runs():
    runs = [{"import_s": 1.2, "transformers": True, "load_s": 2.5, "load_again_s": 0.6,
             "ttft_s": [0.06, 0.03, 0.04], "wall_s": [0.5, 0.4, 0.25], "arithmetic": "q8",
             "metadata": "converted"}]  # fmt: skip
    text = report(runs, "cmd", "auto")
    assert "| 1 | converted | q8 | 1.20 | yes | 2.50 | 0.60 | 60, 30, 40 | 2.00 | 500, 400, 250 | 2.00 |" in text
    assert text.splitlines()[3] == "cmd" and "as this machine had them" in text


def test_an_unseen_run_measures_curves_of_its_own_and_leaves_the_users(tmp_path, monkeypatch):
    """`--unseen`: the processes' cache is the user's, linked entry by entry, but for an empty curves folder."""
    from draftverify.util import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    (cache_root() / "curves").mkdir(parents=True)
    (cache_root() / "curves" / "kept.json").write_text("{}")
    (cache_root() / "gguf-packed").mkdir()
    base = unseen_cache(tmp_path / "run")
    monkeypatch.setenv("XDG_CACHE_HOME", str(base))
    assert (cache_root() / "gguf-packed").resolve() == (tmp_path / "user" / "draftverify" / "gguf-packed").resolve()
    assert not list((cache_root() / "curves").iterdir())
    (cache_root() / "curves" / "new.json").write_text("{}")
    assert [f.name for f in (tmp_path / "user" / "draftverify" / "curves").iterdir()] == ["kept.json"]


def test_it_measures_a_fresh_process_on_the_default_model(tmp_path, capsys):
    main(["--out", str(tmp_path / "r"), "--processes", "2", "--requests", "2", "--max-new-tokens", "2",
          "--method", "auto", "--unseen"])  # fmt: skip
    text = (tmp_path / "r" / "report.md").read_text()
    assert "| 1 | converted |" in text and (tmp_path / "r" / "runs.json").is_file()
    assert "none at the start (`--unseen`)" in text
    (cached,) = [line for line in text.splitlines() if line.startswith("| 2 | cached |")]
    assert cached.split(" | ")[4] == "no"  # a cached GGUF file loads without importing transformers


def test_bad_counts_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="at least 2"):
        main(["--out", str(tmp_path), "--requests", "1"])
