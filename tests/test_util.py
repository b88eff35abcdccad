"""The shared helpers (util.py) and the one method-spec grammar (methods/spec.py)."""

from __future__ import annotations

import pytest

from draftverify.errors import DraftVerifyError
from draftverify.methods.spec import parse_options, parse_spec, parse_specs, read_spec
from draftverify.util import atomic_path, atomic_write, same_weights


def test_atomic_write_replaces_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "sub" / "a.txt"
    atomic_write(path, "one")
    atomic_write(path, b"two")
    assert path.read_text() == "two"
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert path.read_text() == "two" and [p.name for p in path.parent.iterdir()] == ["a.txt"]


def test_atomic_folder_new_and_merged(tmp_path):
    with atomic_path(tmp_path / "new", folder=True) as tmp:
        (tmp / "x").write_text("1")
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["x"]
    (tmp_path / "new" / "keep").write_text("k")
    with atomic_path(tmp_path / "new", folder=True) as tmp:  # an existing folder gets the files one by one
        (tmp / "x").write_text("2")
    assert (
        sorted(p.name for p in (tmp_path / "new").iterdir()) == ["keep", "x"]
        and (tmp_path / "new" / "x").read_text() == "2"
    )
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "gone", folder=True) as tmp:
        (tmp / "x").write_text("1")
        raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


def test_same_weights_one_tolerance():
    a = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "embedding_fingerprint": 10.0,
        "tokenizer": "t",
    }
    assert same_weights(a, {**a, "embedding_fingerprint": 10.09})  # bf16 rounding: within 1%
    assert same_weights(
        {**a, "embedding_fingerprint": 0.0}, {**a, "embedding_fingerprint": 0.04}
    )  # near 0: within 0.05
    assert not same_weights(a, {**a, "embedding_fingerprint": 10.2})
    assert not same_weights(a, {**a, "num_hidden_layers": 5})
    assert same_weights(a, {k: v for k, v in a.items() if k != "tokenizer"})  # a method's identity has no tokenizer
    assert not same_weights(a, {"model_type": "llama"})


def test_one_spec_grammar():
    spec = read_spec(" speculative:k2[k=3,policy=constant] ")
    assert (spec.label, spec.name, spec.preset, spec.options) == (
        "speculative:k2[k=3,policy=constant]",
        "speculative",
        "k2",
        (("k", 3), ("policy", "constant")),
    )
    assert [s.label for s in parse_specs("speculative[k=4,policy=heuristic], lookahead:context,ouroboros")] == [
        "speculative[k=4,policy=heuristic]",
        "lookahead:context",
        "ouroboros",
    ]
    assert parse_options(["k=4", "policy=heuristic", "max-ngram=2.5"]) == {
        "k": 4,
        "policy": "heuristic",
        "max_ngram": 2.5,
    }
    for text, message in [
        ("nope", "unknown method 'nope'"),
        ("hf-assisted", "unknown method"),
        ("speculative[k=0]", "k=0"),
        ("speculative:nope", "unknown preset"),
        ("speculative[warm=false]", "unknown option 'warm'"),
    ]:
        with pytest.raises(DraftVerifyError, match=message):
            parse_spec(text)
    with pytest.raises(DraftVerifyError, match="listed twice"):
        parse_specs("speculative,speculative")
    with pytest.raises(DraftVerifyError, match="write key=value"):
        parse_options(["k"])


def test_the_runtime_imports_no_plot_table_or_tool_dependency():
    """`import draftverify; Engine` (and the CLI's entry point) load what decoding needs, not the extras'."""
    import subprocess
    import sys

    code = (
        "import sys, draftverify; draftverify.Engine; import draftverify.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'matplotlib', 'optuna', 'fastapi', 'uvicorn', 'scipy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    code = "import sys, draftverify; draftverify.Engine; print('rich' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out


def test_a_missing_extra_is_named_in_one_line(monkeypatch):
    import sys

    from draftverify.util import optional_import

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: the import fails as if missing
    with pytest.raises(DraftVerifyError, match=r"matplotlib is not installed: pip install 'draftverify\[bench\]'"):
        optional_import("matplotlib", "bench")
    assert optional_import("json", "bench").dumps([1]) == "[1]"


def test_no_source_file_over_400_lines_and_no_function_over_60():
    """The package (runtime, bench and tools alike) stays readable in pieces: each Python or C++ source file at most
    400 lines, each Python function at most 60 (decorators, docstring and body counted)."""
    import ast
    from pathlib import Path

    import draftverify

    root = Path(draftverify.__file__).parent
    sources = [p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    assert len(sources) > 50
    long_files = {str(p.relative_to(root)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert not long_files, f"split these files: {long_files}"
    long_functions = {}
    for path in (p for p in sources if p.suffix == ".py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > 60:
                    long_functions[f"{path.relative_to(root)}:{node.name}"] = node.end_lineno - first + 1
    assert not long_functions, f"split these functions: {long_functions}"


def test_a_reports_command_carries_the_environment_that_changes_the_run(monkeypatch):
    from draftverify.util import RUN_ENV, command_line

    for name in RUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert command_line("draftverify", ["bench", "--out", "a b"]) == "draftverify bench --out 'a b'"
    monkeypatch.setenv("DRAFTVERIFY_ISA", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("UNRELATED", "1")
    assert command_line("draftverify", ["bench"]) == "DRAFTVERIFY_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 draftverify bench"
