"""The layer search: seeded, time-boxed, resumable, writes an identity-stamped skip set; the CLI."""

from __future__ import annotations

import json

import optuna
import pytest
from typer.testing import CliRunner

from draftverify.drafters.skipsets import SkipSet, load_skip_set
from draftverify.errors import DraftVerifyError
from draftverify.tools.search_layers import WARM_START_SCALES, params_skip, search_layers, skip_params, study_path

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def trials_of(out):
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(study_path(out))))
    return [t for t in optuna.load_study(study_name="skipset", storage=storage).trials if t.state.is_finished()]


def run(target, out, **kw):
    settings = dict(
        budget_s=120, trials=2, seed=0, max_new_tokens=6, progress=False, give_up=None
    )  # timing-independent
    return search_layers(target, PROMPTS, out, **{**settings, **kw})


def test_params_roundtrip():
    skip = SkipSet((0, 3), (2,))
    params = skip_params(skip, 4)
    assert len(params) == 8 and params_skip(params) == skip


def test_search_writes_a_skip_set_and_resumes(tiny, tmp_path):
    target = tiny("llama")
    out = tmp_path / "skip.json"
    result = run(target, out, trials=3)
    assert result.trials == 3 and result.measured.ms_per_token > 0 and result.autoregressive_ms_per_token > 0
    assert load_skip_set(out, target.identity) == result.skip
    doc = json.loads(out.read_text())
    assert doc["model"] == target.identity and doc["search"]["trials"] == 3 and doc["search"]["seed"] == 0
    # the first trials are the paper-like warm starts
    assert [params_skip(t.params) for t in trials_of(out)] == [SkipSet.heuristic(4, s) for s in WARM_START_SCALES[:3]]

    with pytest.raises(DraftVerifyError, match="--resume"):
        run(target, out)
    resumed = run(target, out, resume=True, trials=2)
    assert resumed.trials == 5 and len(trials_of(out)) == 5
    assert params_skip(trials_of(out)[3].params) == SkipSet.heuristic(4, WARM_START_SCALES[3])  # the queue carried over
    assert resumed.measured.ms_per_token <= result.measured.ms_per_token  # the best over both sessions

    with pytest.raises(DraftVerifyError, match="other prompts or settings"):
        run(target, out, resume=True, max_new_tokens=7)
    with pytest.raises(DraftVerifyError, match="another model"):
        run(tiny("llama", seed=1), out, resume=True)
    with pytest.raises(DraftVerifyError, match="made for another model"):
        load_skip_set(out, tiny("llama", seed=1).identity)


def test_search_is_seeded_and_time_boxed(tiny, tmp_path):
    target = tiny("gpt2")
    n = len(WARM_START_SCALES) + 2  # past the warm starts: the sampler's own (seeded) proposals
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    run(target, a, trials=n, seed=3)
    run(target, b, trials=n, seed=3)
    assert [t.params for t in trials_of(a)] == [t.params for t in trials_of(b)]
    boxed = run(target, tmp_path / "c.json", trials=None, budget_s=1e-3)
    assert boxed.trials == 1  # the budget ran out during the first trial, which still finished


def test_search_layers_command(tiny, tmp_path):
    from draftverify.cli import app

    target = tiny("llama")
    folder = tmp_path / "model"
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    prompts = tmp_path / "dev.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "1, 2, 3,", "chat": false}\n')
    out = tmp_path / "skip.json"
    args = [
        "search-layers",
        "--model",
        str(folder),
        "--prompts",
        str(prompts),
        "--budget",
        "2",
        "--trials",
        "2",
        "--out",
        str(out),
        "--max-new-tokens",
        "5",
        "--clock",
        "cpu",
        "--threads",
        "1",
        "--give-up",
        "0",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "best of 2 trials" in result.output and out.is_file() and study_path(out).is_file()
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "Hello",
            "--target",
            str(folder),
            "-m",
            "self-speculative",
            "-o",
            f"skip_file={out}",
            "-n",
            "8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["stats"]["method"] == "self-speculative"


def test_search_measures_in_the_engines_arithmetic(tmp_path, tokenizer):
    """A GGUF target is searched in the arithmetic it decodes in (q8 here): the skip set records it, and a study
    made in one arithmetic is not resumed in another."""
    from test_gguf_archs import write_tiny
    from transformers import AutoConfig, GenerationConfig

    from draftverify import Engine
    from draftverify.loading import Loaded
    from draftverify.loading.gguf_model import GGUFModel
    from draftverify.loading.gguf_weights import GGUFWeights

    write_tiny(tmp_path / "tiny.gguf", "gemma2")
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    model = GGUFModel(
        GGUFWeights(tmp_path / "tiny.gguf", config, tokenizer), GenerationConfig.from_model_config(config)
    )
    target = Loaded(model, tokenizer, name="tiny.gguf", source=tmp_path / "tiny.gguf")
    out = tmp_path / "skip.json"
    run(target, out, trials=1, engine=Engine(target, arithmetic="q8"))
    assert json.loads(out.read_text())["search"]["arithmetic"] == "q8"
    with pytest.raises(DraftVerifyError, match="other prompts or settings"):
        run(target, out, resume=True, trials=1, engine=Engine(target, arithmetic="fp32"))
