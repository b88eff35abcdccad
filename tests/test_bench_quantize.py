"""The default model in the downloaded GGUF types, by llama.cpp's quantizer (skipped without llama-cpp-python)."""

from __future__ import annotations

import pytest

from draftverify.bench import llamacpp
from draftverify.errors import DraftVerifyError


def test_gguf_kinds_name_the_file_llamacpp_runs(tmp_path):
    own = tmp_path / "model.Q4_K_M.gguf"
    own.write_bytes(b"GGUF")
    assert llamacpp.gguf_for(own, "m", "file") == own  # the user's own file, not a copy
    with pytest.raises(DraftVerifyError, match="unknown GGUF kind 'q8'"):
        llamacpp.gguf_for(own, "m", "q8")
    with pytest.raises(DraftVerifyError, match="need a .gguf target"):
        llamacpp.gguf_for(tmp_path, "m", "f32")


@pytest.mark.skipif(not llamacpp.available(), reason=llamacpp.INSTALL_HINT)
def test_default_model_quantized_once_per_type():
    gguf = pytest.importorskip("gguf")
    from draftverify.bench.quantize import quantized
    from draftverify.loading.defaults import default_model_path

    try:
        default_model_path()
    except DraftVerifyError as err:
        pytest.skip(str(err))
    path = quantized("q8_0")
    assert path.is_file() and path.name.endswith(".Q8_0.gguf")
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert "Q8_0" in types and "Q4_1" not in types  # quantized from the F32 export, not copied blocks
    stamp = path.stat().st_mtime_ns
    assert quantized("Q8_0") == path and path.stat().st_mtime_ns == stamp  # cached: not written again
    with pytest.raises(DraftVerifyError, match="unknown GGUF type 'Q9_X'") as err:
        quantized("Q9_X")
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not llamacpp.available(), reason=llamacpp.INSTALL_HINT)
def test_llamacpp_peers_on_the_own_file_and_the_f32_export(tmp_path):
    """`llamacpp` runs the target's own GGUF, `llamacpp-f32` its F32 re-export: both cost curves in the report."""
    from draftverify import Engine
    from draftverify.bench.datasets import Prompt
    from draftverify.bench.runner import Bench, Settings
    from draftverify.bench.specs import parse_specs

    try:
        engine = Engine.load(None, "none")
    except DraftVerifyError as err:
        pytest.skip(str(err))
    prompts = [Prompt("p/1", "p", "x", ("Name a colour.",), True)]
    settings = Settings(max_new_tokens=4, warmup_tokens=2)
    results = Bench(engine, prompts, parse_specs("llamacpp,llamacpp-f32"), settings, tmp_path).run(progress=False)
    assert {"llamacpp", "llamacpp-f32"} <= set(results["cost_model"])
    assert [m["gguf"] for m in results["methods"]] == [None, "file", "f32"]
    assert all(r["new_tokens"] >= 1 for r in results["records"])
    report = (tmp_path / "report.md").read_text()
    assert "llama.cpp forward, the target's own file (ms)" in report and "llama.cpp forward, F32 re-export" in report
    import llama_cpp

    assert f"- llama.cpp peers: llama-cpp-python {llama_cpp.__version__} (" in report


def test_the_report_names_the_cpu_features_llama_cpp_was_built_with():
    info = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512_BF16 = 0 | AMX_INT8 = 0 | OPENMP = 1 | \n"
    assert llamacpp.cpu_features(info) == ["SSE3", "AVX2", "OPENMP"]
    assert llamacpp.cpu_features("no such line") == []


def test_the_llamacpp_peer_prefills_every_request_whole():
    """llama-cpp-python reuses the cached prefix of its previous request; the peer must not (ours prefills every
    request whole): a repeated prompt costs the same evaluation as the first time."""
    pytest.importorskip("llama_cpp")
    from draftverify.loading.defaults import default_model_path
    from draftverify.sampling import Sampling

    peer = llamacpp.LlamaCpp(default_model_path(), 128, 2)
    evaluated, evaluate = [], peer.llm.eval
    peer.llm.eval = lambda tokens: (evaluated.append(len(tokens)), evaluate(tokens))[1]
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 30, 198]  # a chat turn's opening, in the model's vocabulary
    first = peer.generate(ids, Sampling(), 4, ())
    counted = sum(evaluated)
    evaluated.clear()
    again = peer.generate(ids, Sampling(), 4, ())
    assert sum(evaluated) == counted and again["tokens"] == first["tokens"]
