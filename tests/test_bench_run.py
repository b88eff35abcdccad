"""The benchmark end to end on tiny models: a full run, resume after an interruption, the
exactness red flag on an altered output, and `draftverify bench --quick` through the CLI."""

from __future__ import annotations

import json

import pytest

from draftverify import Engine
from draftverify.bench.datasets import Prompt
from draftverify.bench.runner import Bench, Settings
from draftverify.bench.specs import parse_specs
from draftverify.errors import DraftVerifyError

PROMPTS = [
    Prompt("mine/1", "mine", "a", ("Hello there",), True),
    Prompt("mine/2#1", "mine", "b", ("abc abc",), True),
    Prompt("mine/2#2", "mine", "b", ("abc abc", "again"), True),
    Prompt("mine/3", "mine", "b", ("def f(x):",), False),
]
METHODS = "speculative[k=3],speculative:k2[warm=false],auto,hf-assisted,hf-prompt-lookup"


class Interrupt(Exception):
    pass


class Ticks:
    """A clock that moves one millisecond each time it is read."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny("llama"), tiny("llama", seed=1, layers=2))


def bench(engine, out, repeats=1, max_new_tokens=12, methods=METHODS):
    return Bench(engine, PROMPTS, parse_specs(methods), Settings(max_new_tokens=max_new_tokens, repeats=repeats), out)


def test_full_run_outputs_and_exactness(engine, tmp_path):
    results = bench(engine, tmp_path, repeats=2).run(command="draftverify bench --test", progress=False)
    labels = [
        "autoregressive",
        "speculative[k=3]",
        "speculative:k2[warm=false]",
        "auto",
        "hf-assisted",
        "hf-prompt-lookup",
    ]
    assert [m["label"] for m in results["methods"]] == labels
    assert len(results["records"]) == len(PROMPTS) * len(labels) * 2
    # the second turn of mine/2 carries the greedy answer to its first turn
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    context = [r for r in records if r["type"] == "context"]
    assert [c["prompt_id"] for c in context] == ["mine/2#1"]
    first_turn = next(r for r in results["records"] if r["prompt_id"] == "mine/2#1" and r["label"] == "autoregressive")
    assert context[0]["answer"] == engine.target.tokenizer.decode(first_turn["tokens"], skip_special_tokens=True)
    # every method produced the autoregressive tokens (fp32), and transformers' peers did too
    assert all(e["differ"] == 0 and e["compared"] == len(PROMPTS) for e in results["exactness"].values())
    summary = results["summary"]["all"]
    assert summary["autoregressive"]["tokens_per_target_forward"]["median"] == 1.0
    assert summary["hf-assisted"]["draft_share"]["median"] is None  # unknown for a peer, not 0
    assert summary["hf-prompt-lookup"]["draft_forwards_per_token"]["median"] == 0.0
    peer = next(r for r in results["records"] if r["label"] == "hf-assisted")
    assert (
        sum(peer["steps"]) == peer["new_tokens"]
        and peer["target_forwards"] == len(peer["steps"])
        and peer["draft_forwards"] > 0
    )
    assert set(results["summary"]["categories"]) == {"mine/a", "mine/b"}
    oracle = results["oracle"]["all"]
    assert len(oracle["prompts"]) == len(PROMPTS) and all(row["target_forwards"] >= 1 for row in oracle["prompts"])
    for name in ("results.json", "results.csv", "report.md", "speedup.png", "accepted_hist.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# draftverify bench") and "draftverify bench --test" in report
    assert "Every method produced exactly the autoregressive tokens" in report and "RED FLAG" not in report
    assert "### mine/a (1 prompt)" in report and "oracle speedup" in report
    assert "## Winners" in report and "| mine/a | `" in report  # a fastest method named per category
    assert "`auto` / oracle pick" in report  # how close auto came to the best single method, per category
    assert (
        "## The ceiling here" in report and "ceiling: a draft always right and free" in report
    )  # the bound per category
    assert (tmp_path / "results.csv").read_text().count("\n") == len(results["records"]) + 1
    assert json.loads((tmp_path / "results.json").read_text())["environment"]["torch_threads"] >= 1


def test_resume_after_interruption(engine, tmp_path):
    seen = []

    def stop_after_five(record):
        seen.append(record)
        if len(seen) == 6:
            raise Interrupt

    with pytest.raises(Interrupt):
        bench(engine, tmp_path).run(progress=False, on_record=stop_after_five)
    assert not (tmp_path / "report.md").exists()
    done = [(r["prompt_id"], r["label"]) for r in seen]
    assert done == [
        ("mine/1", label)
        for label in (
            "autoregressive",
            "speculative[k=3]",
            "speculative:k2[warm=false]",
            "auto",
            "hf-assisted",
            "hf-prompt-lookup",
        )
    ]
    with open(tmp_path / "records.jsonl", "a") as f:
        f.write('{"type": "generation", "prom')  # and the process died mid-write
    rest = []
    results = bench(engine, tmp_path).run(progress=False, on_record=rest.append)
    assert len(rest) == len(PROMPTS) * 6 - 6 and all(r["prompt_id"] != "mine/1" for r in rest)
    first = {(r["prompt_id"], r["label"]): r for r in seen}
    kept = [r for r in results["records"] if r["prompt_id"] == "mine/1"]
    assert all(r == first[(r["prompt_id"], r["label"])] for r in kept)  # the recorded generations were kept, not rerun
    again = []
    bench(engine, tmp_path).run(progress=False, on_record=again.append)
    assert again == []  # everything was done: the rerun only rewrites the report
    with pytest.raises(DraftVerifyError, match="holds a run with another config .*max_new_tokens: 12 there, 13 now"):
        bench(engine, tmp_path, max_new_tokens=13).run(progress=False)


def test_exactness_red_flag_on_an_altered_output(engine, tmp_path):
    methods = "speculative[k=3]"
    bench(engine, tmp_path, methods=methods).run(progress=False)
    path = tmp_path / "records.jsonl"
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        record = json.loads(line)
        if record.get("label") == methods and record["prompt_id"] == "mine/3":
            record["tokens"][4] = (record["tokens"][4] + 1) % 50  # a wrong token at position 4
            lines[i] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    results = bench(engine, tmp_path, methods=methods).run(progress=False)
    assert results["exactness"][methods] == {
        "compared": 4,
        "differ": 1,
        "cases": [{"prompt_id": "mine/3", "repeat": 0, "position": 4}],
    }
    report = (tmp_path / "report.md").read_text()
    assert "RED FLAG: output differs from autoregressive decoding for `speculative[k=3]` (1 prompts)" in report
    assert "mine/3 (repeat 0): token 4" in report


def test_methods_needing_a_draft_are_refused_without_one(tiny, tmp_path):
    with pytest.raises(DraftVerifyError, match="'hf-assisted' needs a draft model"):
        Bench(Engine(tiny("llama")), PROMPTS, parse_specs("hf-assisted"), Settings(), tmp_path)


def test_llamacpp_peers_say_what_they_need(tiny, tmp_path, monkeypatch):
    from draftverify.bench import llamacpp

    engine = Engine(tiny("llama"))
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(DraftVerifyError, match=r"need llama-cpp-python: run `bash scripts/install-llamacpp.sh`"):
        Bench(engine, PROMPTS, parse_specs("llamacpp"), Settings(), tmp_path)
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    with pytest.raises(DraftVerifyError, match="llama.cpp peers need a .gguf target"):
        Bench(engine, PROMPTS, parse_specs("llamacpp-prompt-lookup"), Settings(), tmp_path)


def test_quick_through_the_cli(tiny, tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target = tiny("llama")
    target.model.save_pretrained(tmp_path / "m")
    target.tokenizer.save_pretrained(tmp_path / "m")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "category": c}) + "\n"
            for p, c in (("Hello", "x"), ("abc abc abc", "y"), ("never used", "y"))
        )
    )
    args = [
        "bench",
        "--datasets",
        "",
        "--prompts",
        str(prompts),
        "--target",
        str(tmp_path / "m"),
        "--draft",
        "self:layers=2",
        "--methods",
        "speculative[k=2],hf-assisted,hf-prompt-lookup,hf-autoregressive",
        "--quick",
        "--out",
        str(tmp_path / "out"),
        "--no-progress",
    ]
    res = CliRunner().invoke(app, args + ["--spec-bench-jsonl", str(tmp_path / "sb")])
    assert res.exit_code == 0, res.output
    assert len(list((tmp_path / "sb").glob("m-*.jsonl"))) == 5  # one Spec-Bench answer file per method
    assert "Headline (all prompts)" in res.stdout and "report:" in res.stdout
    report = (tmp_path / "out" / "report.md").read_text()
    assert (
        "## Forward cost curve" in report
        and "target t(w) / t(1)" in report
        and "Forward path: target: static" in report
    )
    assert "| method | speedup | decode-only speedup | total-time speedup |" in report
    assert "target arithmetic **fp32**" in report  # --dtype auto on a CPU, a target read from safetensors: fp32
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["max_new_tokens"] == 16 and results["config"]["repeats"] == 1
    assert [p["id"] for p in results["prompts"]] == ["prompts/1", "prompts/2"]  # --quick: 2 prompts
    assert all(r["new_tokens"] <= 16 for r in results["records"])
    assert all(e["differ"] == 0 for e in results["exactness"].values())
    res = CliRunner().invoke(
        app, args[:-4] + ["--max-new-tokens", "8", "--out", str(tmp_path / "out"), "--no-progress"]
    )
    assert res.exit_code != 0 and "holds a run with another config" in str(res.exception)
    res = CliRunner().invoke(app, ["bench", "--methods", "nope", "--prompts", str(prompts), "--datasets", ""])
    assert res.exit_code != 0 and "unknown method 'nope'" in str(res.exception)


def test_every_repeat_of_a_prompt_starts_from_the_same_warm_state(engine, tmp_path, monkeypatch):
    """Ouroboros keeps its phrase pool across requests and `auto` its figures: a later repeat of a prompt must not
    draft from the first repeat's own reply, so every repeat runs the same rounds."""
    from draftverify.drafters import auto

    # auto on a clock that moves a millisecond a reading: a choice priced by the time its own rounds took on the
    # real clock differs from one repeat to the next however the warm state is restored
    monkeypatch.setattr(auto, "time", Ticks())
    results = bench(engine, tmp_path, repeats=3, max_new_tokens=24, methods="ouroboros,auto").run(progress=False)
    for label in ("ouroboros", "auto"):
        for prompt in PROMPTS:
            runs = [r for r in results["records"] if r["label"] == label and r["prompt_id"] == prompt.id]
            assert len(runs) == 3
            assert len({(r["target_forwards"], r["accepted"], r["drafted"]) for r in runs}) == 1, (label, prompt.id)
    # the warm start from one prompt to the next stays: the pool the last prompt met holds the earlier replies
    method = engine.method("ouroboros")
    assert method.warm_state() is not None and len(method.warm_state()) > 0
