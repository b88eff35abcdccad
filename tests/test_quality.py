"""`draftverify quality` (tools/quality.py) on any quantized GGUF target: a short run on the default model, and the
one-line refusal of a target that has nothing for q8 to multiply."""

import json

from typer.testing import CliRunner

from draftverify.cli import app


def test_quality_measures_q8_against_fp32_and_writes_the_record(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    args = ["quality", "-t", "smollm2-135m", "--text", str(text), "--prompts", "1", "--tokens", "4"]
    run = CliRunner().invoke(app, [*args, "--window", "16", "--text-tokens", "32", "--out", str(tmp_path / "out")])
    assert run.exit_code == 0, run.output
    record = json.loads((tmp_path / "out" / "SmolLM2-135M-Instruct.Q4_1.json").read_text())
    assert record["scored"] == 32 and record["prompts"] == 1 and record["tokens"] == 4
    assert 1 < record["ppl_fp32"] < 1000 and 1 < record["ppl_q8"] < 1000 and record["ppl_q8"] != record["ppl_fp32"]
    assert (
        "# q8 against fp32: SmolLM2-135M-Instruct.Q4_1.gguf"
        in (tmp_path / "out" / "SmolLM2-135M-Instruct.Q4_1.md").read_text()
    )


def test_quality_refuses_a_target_without_quantized_layers(tmp_path):
    from test_arithmetic import tiny_gguf

    floats = tiny_gguf(tmp_path / "floats.gguf", "F32")
    run = CliRunner().invoke(app, ["quality", "-t", str(floats), "--out", str(tmp_path / "out")])
    assert run.exit_code != 0 and "is not a quantized GGUF file" in str(run.exception)
    assert not (tmp_path / "out").exists()
