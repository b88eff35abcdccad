"""Stopping inside accepted chunks, streaming, generation configs, bad input, the CLI."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from draftverify import DraftVerifyError, Engine, Sampling, Stopping
from draftverify.loading import check_same_tokenizer, load_draft, load_model, truncated_copy


@pytest.fixture(scope="module")
def engine(tiny):
    target = tiny("llama")
    return Engine(target, target)  # the target as its own draft: every draft is accepted, chunks are long


def test_eos_inside_accepted_chunk(engine):
    full = engine.generate("Hello", method="autoregressive", max_new_tokens=30, eos_token_id=[])
    eos = full.tokens[7]
    cut = full.tokens.index(eos) + 1
    for method, options in (("autoregressive", {}), ("speculative", {"k": 8})):
        r = engine.generate("Hello", method=method, max_new_tokens=30, eos_token_id=eos, **options)
        assert r.tokens == full.tokens[:cut] and r.stats.finish_reason == "eos"


def test_stop_string_inside_accepted_chunk(engine):
    full = engine.generate("Hello", method="autoregressive", max_new_tokens=30, eos_token_id=[])
    stop = full.text[10:12]
    first = full.text.find(stop)
    results = [
        engine.generate("Hello", method="autoregressive", max_new_tokens=30, eos_token_id=[], stop=stop),
        engine.generate(
            "Hello", method="speculative", max_new_tokens=30, eos_token_id=[], stop=stop, policy="constant", k=8
        ),
    ]
    assert results[0].tokens == results[1].tokens
    assert results[1].text == full.text[:first] and results[1].stats.finish_reason == "stop"


def test_max_new_tokens_inside_chunk(engine):
    for n in (1, 2, 5, 9):
        r = engine.generate("Hello", method="speculative", max_new_tokens=n, eos_token_id=[], policy="constant", k=8)
        assert len(r.tokens) == n and r.stats.finish_reason == "length"


def test_text_iterator_streamer(engine):
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(engine.target.tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(
            r=engine.generate("Hello", method="speculative", max_new_tokens=20, eos_token_id=[], streamer=streamer)
        )
    )
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text == result["r"].text


def test_on_tokens_receives_chunks_and_can_cancel(engine):
    chunks = []
    r = engine.generate(
        "Hello",
        method="speculative",
        max_new_tokens=30,
        eos_token_id=[],
        policy="constant",
        k=4,
        on_tokens=lambda c: chunks.append(c),
    )
    assert sum(chunks, []) == r.tokens and max(map(len, chunks)) > 1
    r = engine.generate("Hello", method="speculative", max_new_tokens=30, eos_token_id=[], on_tokens=lambda c: False)
    assert r.stats.finish_reason == "cancelled" and len(r.tokens) <= 5


def test_generation_config(engine):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=6, do_sample=False)
    assert len(engine.generate("Hello", generation_config=gc, eos_token_id=[]).tokens) == 6
    gc = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5)
    a = engine.generate("Hello", generation_config=gc, seed=3, eos_token_id=[])
    b = engine.generate("Hello", generation_config=gc, seed=3, eos_token_id=[])
    assert a.tokens == b.tokens  # seeded runs are reproducible


def test_chat_template_applied(engine):
    ids = engine.encode("hi", chat=True)
    assert engine.target.tokenizer.decode(ids) == "<user>hi\n<assistant>"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "   ", "chat": True}, "prompt is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": -1.0}, "temperature=-1.0 is negative"),
        ({"top_p": 0.0}, "top_p=0.0 is outside"),
        ({"top_p": 1.5}, "top_p=1.5 is outside"),
        ({"prompt": "x" * 600}, "context is 512"),
        ({"method": "nope"}, "unknown method 'nope'"),
        ({"method": "speculative", "k": 0}, "k=0 must lie in 1..64"),
        ({"bogus": 1}, "unknown option 'bogus'"),
        ({"preset": "nope"}, "unknown preset 'nope'"),
    ],
)
def test_bad_input_messages(engine, kwargs, message):
    kwargs = {"prompt": "Hello", **kwargs}
    with pytest.raises(DraftVerifyError, match=message) as err:
        engine.generate(kwargs.pop("prompt"), **kwargs)
    assert "\n" not in str(err.value)


def test_method_options_never_shadow_request_settings():
    """A method's options travel beside the request's settings (`Engine.generate(**settings)`, the bench, the
    server): an option named like a setting (`top_k`, `seed`) would fail as a duplicate keyword or, worse, be taken
    for it."""
    import dataclasses
    import inspect

    from draftverify.methods import METHODS

    settings = set(inspect.signature(Engine.request).parameters) - {"self", "options"}
    for name, cls in METHODS.items():
        clash = settings & {f.name for f in dataclasses.fields(cls.Config)}
        assert not clash, f"{name} has options named like request settings: {clash}"


def test_method_needing_draft_without_one(tiny):
    with pytest.raises(DraftVerifyError, match="needs a draft model"):
        Engine(tiny("llama")).generate("Hello", method="speculative")


def test_mismatched_tokenizers_are_refused(tokenizer):
    import copy

    changed = copy.deepcopy(tokenizer)
    changed.add_tokens(["<extra>"])
    check_same_tokenizer(tokenizer, copy.deepcopy(tokenizer))
    with pytest.raises(DraftVerifyError, match="tokenizers differ"):
        check_same_tokenizer(tokenizer, changed)


def test_bad_paths_and_specs(tmp_path, tiny):
    with pytest.raises(DraftVerifyError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(DraftVerifyError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(DraftVerifyError, match="bad draft spec"):
        load_draft("self:layerz=2", tiny("llama"))
    with pytest.raises(DraftVerifyError, match="self:layers=9 is impossible"):
        truncated_copy(tiny("llama"), 9)
    with pytest.raises(DraftVerifyError, match="max_new_tokens=0"):
        Stopping(max_new_tokens=0)
    with pytest.raises(DraftVerifyError, match="temperature"):
        Sampling(temperature=-0.5)


def test_local_folder_load_and_cli(tmp_path, tiny):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target = tiny("llama")
    target.model.save_pretrained(tmp_path / "m")
    target.tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m", device="cpu")
    assert torch.equal(loaded.model.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    runner = CliRunner()
    outs = {}
    for method in ("autoregressive", "speculative", "speculative:k2[policy=constant]"):  # any method spec
        res = runner.invoke(
            app,
            [
                "generate",
                "Hello",
                "--target",
                str(tmp_path / "m"),
                "--draft",
                "self:layers=2",
                "--method",
                method,
                "-n",
                "12",
                "--json",
                "--no-chat",
            ],
        )
        assert res.exit_code == 0, res.output
        outs[method] = json.loads(res.stdout.strip().splitlines()[-1])
    assert (
        outs["autoregressive"]["tokens"]
        == outs["speculative"]["tokens"]
        == outs["speculative:k2[policy=constant]"]["tokens"]
    )
    assert outs["speculative"]["stats"]["target_forwards"] >= 1
    res = runner.invoke(app, ["generate", "--help"])
    assert "--temperature" in res.stdout and "--max-new-tokens" in res.stdout


def test_demo_command_compares_methods(tmp_path, tiny):
    from typer.testing import CliRunner

    from draftverify.cli import app

    model = tiny("llama")
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    res = CliRunner().invoke(
        app,
        [
            "demo",
            "--target",
            str(tmp_path / "m"),
            "--draft",
            "self:layers=2",
            "-n",
            "12",
            "--repeats",
            "2",
            "--method",
            "auto,lookahead:context",
        ],
    )
    assert res.exit_code == 0, res.output
    header = (
        "| prompt | autoregressive tok/s | auto tok/s | speedup | identical "
        "| lookahead:context tok/s | speedup | identical |"
    )
    assert header in res.stdout and "--- code: " in res.stdout
    rows = [line for line in res.stdout.splitlines() if line.startswith(("| chat |", "| code |", "| summary |"))]
    assert len(rows) == 3 and all(row.count("| yes |") == 2 for row in rows)


def test_two_engines_in_one_process_do_not_steer_each_other(tiny):
    """Cost curves, the feature head's calibration and packed weights belong to an engine (`models.Shared`):
    what one engine measures or learns is not what another one reads."""
    from test_feature_head import random_head

    from draftverify.costs import curve
    from draftverify.drafters.feature import acceptance

    target = tiny("llama")
    head = random_head(target)
    one, two = Engine(target, backend="static"), Engine(target, backend="static")
    measured = curve(one.target_runner, widths=(1, 2))
    assert curve(one.slot(1)[0], widths=(1, 2)) is measured  # the engine's own slots share it
    assert curve(two.target_runner, widths=(1, 2)) is not measured
    _, session = one.request([5, 6, 7], max_new_tokens=2)
    learned, fresh = acceptance(head, one.target_runner, session), acceptance(head, two.target_runner, session)
    before = fresh(0.5)
    for _ in range(50):
        learned.record(0.5, accepted=False)
    assert learned(0.5) < before and acceptance(head, two.target_runner, session)(0.5) == before
    assert acceptance(head, one.slot(1)[0], session) is learned


def test_demo_leaves_out_a_method_whose_drafts_were_never_built(tmp_path, tiny):
    """The demo runs the methods that can run on the target; one that needs a build says so in one line."""
    from typer.testing import CliRunner

    from draftverify.cli import app

    model = tiny("llama")
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    args = ["demo", "--target", str(tmp_path / "m"), "-n", "8", "--repeats", "1", "--method", "auto,self-speculative"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "self-speculative: left out: no skip set" in res.output and "build-drafts" in res.output
    assert "| auto tok/s |" in res.stdout and "self-speculative tok/s" not in res.stdout
