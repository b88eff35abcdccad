"""The target arithmetic's default rule (draftverify.arithmetic): q8 for every quantized GGUF target where the kernels
build, read from the file."""

import pytest

from draftverify import arithmetic as ar


def test_split_dtype():
    assert ar.split_dtype("q8") == ("fp32", "q8")
    assert ar.split_dtype("fp32") == ("fp32", "fp32")
    assert ar.split_dtype("bf16") == ("bf16", "fp32")
    assert ar.split_dtype("auto") == ("auto", None)


@pytest.mark.parametrize(
    "record,ok",
    [
        ({"ppl_fp32": 10.0, "ppl_q8": 10.05}, True),
        ({"ppl_fp32": 10.0, "ppl_q8": 10.2}, False),  # 2% worse: fp32 stays the default
        ({"ppl_fp32": 10.0}, False),
        (None, False),
    ],
)
def test_within_tolerance(record, ok):
    assert ar.within_tolerance(record) is ok


def tiny_gguf(path, ggml_type: str):
    """A GGUF file with one layer weight of `ggml_type` ("F32", "F16" or "Q8_0") and an F32 norm."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    weight = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[ggml_type]
    data = (
        gguf.quants.quantize(weight, kind)
        if ggml_type == "Q8_0"
        else weight.astype(np.float16 if ggml_type == "F16" else np.float32)
    )
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=kind if ggml_type == "Q8_0" else None)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_quantized_layers_reads_the_file_not_its_name(tmp_path):
    from draftverify.loading import default_model_path

    assert ar.quantized_layers(default_model_path())  # Q4_1 layers
    assert ar.quantized_layers(tiny_gguf(tmp_path / "named-anything.gguf", "Q8_0"))
    assert not ar.quantized_layers(tiny_gguf(tmp_path / "f32.gguf", "F32"))
    assert not ar.quantized_layers(tiny_gguf(tmp_path / "f16.gguf", "F16"))


def test_default_rule(tmp_path, monkeypatch):
    """q8 for every quantized GGUF target on a CPU whose kernels build (AVX2 or more), whatever the file's name;
    fp32 for a file of float layers, a safetensors folder, another device or backend, or without the kernels."""
    import draftverify.kernels as kernels

    quantized = tiny_gguf(tmp_path / "never-measured-model.Q8_0.gguf", "Q8_0")
    floats = tiny_gguf(tmp_path / "float-model.gguf", "F32")
    monkeypatch.setattr(kernels, "cpu", lambda: object())  # compiled kernels: VNNI, AVX-VNNI or AVX2 alike
    assert ar.Q8_DEFAULT and ar.default_arithmetic(quantized, "cpu")[0] == "q8"
    assert ar.default_arithmetic(quantized, "cpu", backend="static")[0] == "q8"
    assert ar.default_arithmetic(floats, "cpu") == (
        "fp32",
        "float-model.gguf has no quantized layer weights for q8 to multiply",
    )
    assert ar.default_arithmetic(tmp_path, "cpu")[0] == "fp32"  # a safetensors folder
    assert ar.default_arithmetic(quantized, "cuda")[0] == "fp32"
    for backend in ("eager", "graph"):  # no q8 products there: `--backend eager` alone must load the default model
        assert ar.default_arithmetic(quantized, "cpu", backend=backend) == (
            "fp32",
            f"backend {backend!r} has no q8 products",
        )
    monkeypatch.setattr(ar, "Q8_DEFAULT", False)  # the switch: every condition met, fp32
    assert ar.default_arithmetic(quantized, "cpu") == ("fp32", "q8 is switched off (arithmetic.Q8_DEFAULT)")
    monkeypatch.setattr(ar, "Q8_DEFAULT", True)
    monkeypatch.setattr(kernels, "cpu", lambda: None)  # no compiler, or not x86-64 with AVX2: q8 would be numpy's
    monkeypatch.setattr(kernels, "_why_not", "no C++ compiler")
    assert ar.default_arithmetic(quantized, "cpu") == (
        "fp32",
        "no compiled CPU kernels for q8's integer products here (no C++ compiler)",
    )


def test_the_file_already_opened_is_read_for_the_rule(monkeypatch):
    """`load_target` hands the rule the GGUF file it opened: its tensor types decide, not the path's name."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T

    import draftverify.kernels as kernels

    monkeypatch.setattr(kernels, "cpu", lambda: object())
    q4_k = SimpleNamespace(tensors={"blk.0.ffn_up.weight": SimpleNamespace(ggml_type=T.Q4_K)})
    f16 = SimpleNamespace(tensors={"blk.0.ffn_up.weight": SimpleNamespace(ggml_type=T.F16),
                                   "token_embd.weight": SimpleNamespace(ggml_type=T.Q4_K)})  # fmt: skip
    assert ar.default_arithmetic("/x/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "cpu", file=q4_k)[0] == "q8"
    assert ar.default_arithmetic("/x/m.gguf", "cpu", file=f16)[0] == "fp32"  # only the embedding has blocks


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_auto_weights_are_fp32_on_every_device(device):
    """bf16 rounds a verified row differently from a one-token step (docs/backends.md), so no device defaults to it."""
    import torch

    from draftverify.loading.hf import resolve_dtype

    assert resolve_dtype("auto", device) is torch.float32
    assert resolve_dtype("bf16", device) is torch.bfloat16
