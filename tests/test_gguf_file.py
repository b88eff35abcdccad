"""kernels/gguf_file.py against the gguf package's own reader: small files written with gguf.GGUFWriter (every
metadata value type, tensors of several GGML types) and the default model's file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as T

from draftverify.kernels.gguf_file import GGUFError, GGUFFile


def reader_value(field):
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


def assert_same_as_reader(ours: GGUFFile, theirs: GGUFReader, skip_values=()):
    assert ours.keys() == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key in ours.keys():
        if key in skip_values:
            continue
        mine = ours.value(key)
        mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
        want = reader_value(theirs.fields[key])
        assert mine == pytest.approx(want) if isinstance(want, float) else mine == want, key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.shape == tuple(int(n) for n in reversed(t.shape))
        assert mine.nbytes == t.n_bytes and mine.raw.tobytes() == t.data.tobytes(), t.name
        assert mine.raw.base is not None  # a view of the map, not a copy


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.flag", True)
    w.add_string("test.name", "héllo")
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.strings", ["a", "", "ccc"] * 50)
    rng = np.random.default_rng(0)
    weights = {
        "a.f32": (rng.standard_normal((3, 64)).astype(np.float32), T.F32),
        "b.q8_0": (rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0),
        "c.q4_1": (rng.standard_normal((2, 96)).astype(np.float32), T.Q4_1),
        "d.f16": (rng.standard_normal((5, 32)).astype(np.float32), T.F16),
        "e.norm": (rng.standard_normal(10).astype(np.float32), T.F32),
    }
    for name, (array, kind) in weights.items():
        data = array if kind == T.F32 else gq.quantize(array, kind)
        w.add_tensor(name, data, raw_dtype=None if kind == T.F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_small_file_matches_ggufs_reader(small_file):
    ours = GGUFFile(small_file)
    assert ours.value("test.strings")[:4] == ["a", "", "ccc", "a"] and ours.value("missing", 3) == 3
    assert ours.tensors["c.q4_1"].type_name == "Q4_1" and ours.tensors["c.q4_1"].shape == (2, 96)
    assert_same_as_reader(ours, GGUFReader(small_file))
    from draftverify.kernels.blocks import pack_tensor

    reader = {t.name: t for t in GGUFReader(small_file).tensors}
    for name in ("b.q8_0", "c.q4_1", "d.f16", "a.f32"):
        want = gq.dequantize(reader[name].data, reader[name].tensor_type).astype(np.float32)
        assert np.array_equal(pack_tensor(ours.tensors[name]).dequantize().numpy(), want), name
    with pytest.raises(ValueError, match="only 2-D"):
        pack_tensor(ours.tensors["e.norm"])


def test_bad_files_say_what_is_wrong(tmp_path, small_file):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)
    path.write_bytes(small_file.read_bytes()[:100])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(path)


def test_default_model_matches_ggufs_reader():
    from draftverify.loading.defaults import default_model_path

    try:
        path = default_model_path()
    except Exception as exc:  # noqa: BLE001 (the default model is an optional install)
        pytest.skip(str(exc))
    ours = GGUFFile(path)
    assert ours.value("general.architecture") == "llama" and len(ours.value("tokenizer.ggml.tokens")) > 1000
    assert_same_as_reader(ours, GGUFReader(path))
