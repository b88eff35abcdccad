"""The target arithmetic's default rule (draftverify.arithmetic) reads the published quality record."""

import json

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


def test_default_rule(tmp_path, monkeypatch):
    import draftverify.kernels as kernels

    path = tmp_path / "q.json"
    path.write_text(
        json.dumps({"m.gguf": {"ppl_fp32": 10.0, "ppl_q8": 10.01}, "bad.gguf": {"ppl_fp32": 1, "ppl_q8": 2}})
    )
    monkeypatch.setattr(kernels, "cpu", lambda: object())  # compiled kernels: VNNI, AVX-VNNI or AVX2 alike
    assert ar.Q8_DEFAULT and ar.default_arithmetic("/x/m.gguf", "cpu", path)[0] == "q8"
    assert ar.default_arithmetic("/x/bad.gguf", "cpu", path)[0] == "fp32"
    assert ar.default_arithmetic("/x/unknown.gguf", "cpu", path)[0] == "fp32"
    assert ar.default_arithmetic("/x/model-folder", "cpu", path)[0] == "fp32"  # safetensors
    assert ar.default_arithmetic("/x/m.gguf", "cuda", path)[0] == "fp32"
    assert ar.default_arithmetic("/x/m.gguf", "cpu", path, backend="static")[0] == "q8"
    for backend in ("eager", "graph"):  # no q8 products there: `--backend eager` alone must load the default model
        assert ar.default_arithmetic("/x/m.gguf", "cpu", path, backend=backend) == (
            "fp32",
            f"backend {backend!r} has no q8 products",
        )
    monkeypatch.setattr(ar, "Q8_DEFAULT", False)  # the switch: every condition met, fp32
    assert ar.default_arithmetic("/x/m.gguf", "cpu", path) == ("fp32", "q8 is switched off (arithmetic.Q8_DEFAULT)")
    monkeypatch.setattr(ar, "Q8_DEFAULT", True)
    monkeypatch.setattr(kernels, "cpu", lambda: None)  # no compiler, or not x86-64 with AVX2: q8 would be numpy's
    monkeypatch.setattr(kernels, "_why_not", "no C++ compiler")
    assert ar.default_arithmetic("/x/m.gguf", "cpu", path) == (
        "fp32",
        "no compiled CPU kernels for q8's integer products here (no C++ compiler)",
    )


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_auto_weights_are_fp32_on_every_device(device):
    """bf16 rounds a verified row differently from a one-token step (docs/backends.md), so no device defaults to it."""
    import torch

    from draftverify.loading.hf import resolve_dtype

    assert resolve_dtype("auto", device) is torch.float32
    assert resolve_dtype("bf16", device) is torch.bfloat16
