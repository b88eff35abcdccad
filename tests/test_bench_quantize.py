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
    from draftverify.models import default_model_path

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
