"""The feature draft head built on a tiny target: drafting with it is lossless, it is refused on another target,
builds resume, the CLI builds one. Drafting in detail: test_feature_head_drafting.py; its training data and loss:
test_feature_head_data.py."""

from __future__ import annotations

import json
import traceback

import pytest
import torch

from draftverify import Engine
from draftverify.errors import DraftVerifyError
from draftverify.feature_head import FeatureHead, HeadConfig
from draftverify.loading import load_draft
from draftverify.tools.make_draft.feature_head import HeadTraining, build_head

WORDS = ["apple", "river", "stone", "cloud", "green", "quick", "seven", "paper"]
TINY = dict(
    gen_batch=8,
    max_new_tokens=24,
    max_prompt_tokens=64,
    heldout=4,
    vocab=60,
    batch_tokens=512,
    max_len=96,
    epochs=5,
    budget_minutes=2.0,
    lr=3e-3,
    warmup=5,
)


def quiet(_):
    pass


def random_head(target, seed: int = 0, vocab: list[int] | None = None) -> FeatureHead:
    torch.manual_seed(seed)
    vocab = vocab or list(range(target.model.config.vocab_size))
    head = FeatureHead(HeadConfig.for_target(target, vocab)).bind(target)
    head.init_from(target)
    with torch.no_grad():
        head.fc.weight.add_(0.3 * torch.randn_like(head.fc.weight))
    return head.eval()


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """A head trained for a few seconds on a tiny target's replies to 48 prompts."""
    target = tiny("llama", layers=2)
    folder = tmp_path_factory.mktemp("head")
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{WORDS[i % 8]} {WORDS[i * 3 % 8]} {i}"}) + "\n" for i in range(48))
    )
    facts = build_head(target, folder / "out", prompts, HeadTraining(**TINY), log=quiet, progress=False)
    return target, folder / "out", prompts, facts


@pytest.mark.parametrize("backend", ["static", "eager"])
def test_speculative_and_ouroboros_with_the_head_are_lossless(built, backend):
    target, out, _, _ = built
    engine = Engine(target, load_draft(str(out), target), backend=backend)
    accepted = 0
    for prompt in ("apple river 3", "cloud stone seven", "paper"):
        ids = engine.encode(prompt, chat=True)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
        options_list = ({}, {"nodes": 12}, {"preset": "chain", "nodes": 5}, {"k": 2, "nodes": 4})
        for method, options in [("speculative", o) for o in options_list] + [("ouroboros", {})]:
            r = engine.generate(ids, method=method, max_new_tokens=30, eos_token_id=[], **options)
            assert r.tokens == ar.tokens, (backend, prompt, method, options)
            accepted += r.stats.accepted
    assert accepted > 20  # the trained head agrees with its target: the accepted paths' features are exercised


def test_a_long_prompt_feeds_the_head_only_its_latest_positions(built, monkeypatch):
    """The head's catch-up is capped (feature.CATCH_UP; auto's head at auto.HEAD_CATCH_UP): a prompt longer than the
    cap, and rounds sat out in `auto`, feed only the latest positions; the head still drafts and output is AR's."""
    from draftverify.drafters import feature
    from draftverify.methods import auto

    monkeypatch.setattr(feature, "CATCH_UP", 6)
    monkeypatch.setattr(auto, "HEAD_CATCH_UP", 5)  # auto's head feeds fewer
    fed = []
    forward = feature.HeadCache.forward

    def catch_up(self, f, t, p, mask=None):  # the catch-up forwards (an expansion passes its tree mask)
        if mask is None:
            fed.append(len(t))
        return forward(self, f, t, p, mask)

    monkeypatch.setattr(feature.HeadCache, "forward", catch_up)
    target, out, _, _ = built
    engine = Engine(target, load_draft(str(out), target))
    ids = engine.encode("apple river 3 cloud stone seven paper apple river", chat=True)
    assert len(ids) > 6
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
    runs = (("speculative", {"preset": "chain"}, 6), ("auto", {"use": "head+context", "probe": 3}, 5))
    for method, options, most in runs:
        fed.clear()
        r = engine.generate(ids, method=method, max_new_tokens=30, eos_token_id=[], **options)
        assert r.tokens == ar.tokens and max(fed) == most, (method, fed)
    fixed = engine.generate(ids, method="speculative", preset="chain", nodes=3, max_new_tokens=30, eos_token_id=[])
    assert (
        fixed.tokens == ar.tokens and fixed.stats.drafted > 0
    )  # a fixed tree size: the head drafts after a capped catch-up


def test_the_head_is_refused_on_another_target(built, tiny):
    _, out, _, _ = built
    with pytest.raises(DraftVerifyError, match="make-draft --kind head"):
        load_draft(str(out), tiny("llama", seed=5, layers=2))


def test_built_head_has_a_card_and_learned(built):
    _, out, _, facts = built
    card = (out / "README.md").read_text()
    assert "Built with" in card and f"{facts['heldout_top1'][0]:.3f}" in card and "whole build" in card
    assert facts["heldout_top1"][0] > 0.3, facts["heldout_top1"]


def test_interrupted_build_resumes_to_the_same_weights(built, tmp_path):
    target, _, prompts, _ = built
    settings = {**TINY, "epochs": 2, "budget_minutes": 30.0}  # the epochs bound the schedule, not the time
    whole = build_head(target, tmp_path / "a", prompts, HeadTraining(**settings, steps=6), log=quiet, progress=False)
    build_head(target, tmp_path / "b", prompts, HeadTraining(**settings, steps=3), log=quiet, progress=False)
    with pytest.raises(DraftVerifyError, match="--resume"):
        build_head(target, tmp_path / "b", prompts, HeadTraining(**settings, steps=6), log=quiet, progress=False)
    resumed = build_head(
        target, tmp_path / "b", prompts, HeadTraining(**settings, steps=6), resume=True, log=quiet, progress=False
    )
    assert resumed["steps"] == whole["steps"] == 6
    assert "resumed over several runs" in (tmp_path / "b" / "README.md").read_text()
    a = FeatureHead.load(tmp_path / "a").state_dict()
    b = FeatureHead.load(tmp_path / "b").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_the_written_head_is_the_best_evaluated_one(built, tmp_path, monkeypatch):
    """Evaluations every ten steps (a short schedule): the weights of the best one are written, not the last."""
    from draftverify.tools.make_draft import feature_head

    target, _, prompts, _ = built
    settings = {**TINY, "epochs": 2, "budget_minutes": 30.0}
    kept = build_head(target, tmp_path / "a", prompts, HeadTraining(**settings, steps=10), log=quiet, progress=False)
    assert kept["kept_step"] == 10 and kept["of_steps"] >= 25
    scores = iter([[0.9, 0.5, 0.2]])  # step 10's evaluation is the best; 20's, 25's and the final one are worse
    monkeypatch.setattr(feature_head, "acceptance", lambda *a: next(scores, [0.1, 0.1, 0.1]))
    facts = build_head(target, tmp_path / "b", prompts, HeadTraining(**settings, steps=25), log=quiet, progress=False)
    assert facts["steps"] == 25 and facts["kept_step"] == 10 and facts["of_steps"] == kept["of_steps"]
    state = torch.load(tmp_path / "b" / ".make-draft" / "head-checkpoint.pt", weights_only=True)
    assert [e["step"] for e in state["history"]] == [10, 20, 25] and state["best"]["step"] == 10
    assert "the weights of step 10" in (tmp_path / "b" / "README.md").read_text()
    a, b = FeatureHead.load(tmp_path / "a").state_dict(), FeatureHead.load(tmp_path / "b").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_resumed_build_keeps_its_schedule(built, tmp_path, monkeypatch):
    """The schedule's length and batch are fixed once and kept in the checkpoint: a resumed build uses them (it
    would compute others here); its training settings must be the checkpoint's."""
    from draftverify.tools.make_draft import feature_head

    target, _, prompts, _ = built
    settings = {**TINY, "budget_minutes": 30.0}
    monkeypatch.setattr(feature_head, "schedule_length", lambda *a: 40)
    first = build_head(target, tmp_path / "b", prompts, HeadTraining(**settings, steps=5), log=quiet, progress=False)
    state = torch.load(tmp_path / "b" / ".make-draft" / "head-checkpoint.pt", weights_only=True)
    assert first["of_steps"] == state["total"] == 40 and state["batch_tokens"] == first["batch_tokens"] < 512
    monkeypatch.setattr(feature_head, "schedule_length", lambda *a: 77)
    monkeypatch.setattr(feature_head, "epoch_batch_tokens", lambda *a: 512)
    with pytest.raises(DraftVerifyError, match="other training settings"):
        build_head(
            target, tmp_path / "b", prompts, HeadTraining(**{**settings, "lr": 1e-3}, steps=8), resume=True, log=quiet
        )
    again = build_head(
        target, tmp_path / "b", prompts, HeadTraining(**settings, steps=8), resume=True, log=quiet, progress=False
    )
    assert again["steps"] == 8 and again["of_steps"] == 40 and again["batch_tokens"] == first["batch_tokens"]


def test_bad_prompt_file_gets_a_one_line_error(built, tmp_path):
    target, _, _, _ = built
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(DraftVerifyError, match="line 2 is not a JSON object"):
        build_head(target, tmp_path / "x", bad, HeadTraining(**TINY), log=quiet, progress=False)


def test_cli_builds_a_head(built, tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target, _, prompts, _ = built
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    result = CliRunner().invoke(
        app,
        [
            "make-draft",
            "--kind",
            "head",
            "--target",
            str(tmp_path / "target"),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "h"),
            "--vocab",
            "50",
            "--epochs",
            "1",
            "--gen-batch",
            "16",
            "--max-new-tokens",
            "8",
            "--heldout",
            "4",
            "--budget-minutes",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output + "".join(traceback.format_exception(*result.exc_info))
    assert {"feature_draft.json", "model.safetensors", "README.md"} <= {p.name for p in (tmp_path / "h").iterdir()}
    result = CliRunner().invoke(app, ["make-draft", "--kind", "head", "--out", str(tmp_path / "h2")])
    assert result.exit_code != 0 and "--prompts" in str(result.exception)


def test_template_prompts_add_data_beside_the_prompts_and_init_starts_from_a_head(built, tiny, tmp_path):
    """`--templates N` answers N prompts written from the stdlib templates into a folder of its own (the replies to
    --prompts stay usable); `--init HEAD` starts from that head's weights and vocabulary."""
    target, out, prompts, facts = built
    settings = {**TINY, "max_prompt_tokens": 256}
    plain = build_head(
        target,
        tmp_path / "a",
        prompts,
        HeadTraining(**settings, steps=0),
        work=tmp_path / "w",
        log=quiet,
        progress=False,
    )
    more = build_head(
        target,
        tmp_path / "b",
        prompts,
        HeadTraining(**settings, templates=24, steps=0),
        work=tmp_path / "w2",
        init=out,
        log=quiet,
        progress=False,
    )
    assert len(list((tmp_path / "w2" / "features-templates").glob("shard-*.pt"))) >= 1
    assert plain["prompt_sequences"] == more["prompt_sequences"] == plain["sequences"] < more["sequences"]
    assert (
        more["template_heldout_top1"] is not None and "stdlib templates" in (tmp_path / "b" / "README.md").read_text()
    )
    start, head = FeatureHead.load(out), FeatureHead.load(tmp_path / "b")
    assert head.config.vocab == start.config.vocab
    assert all(torch.equal(a, b) for a, b in zip(start.state_dict().values(), head.state_dict().values()))
    with pytest.raises(DraftVerifyError, match="another target or settings"):  # another count is another data set
        build_head(
            target,
            tmp_path / "c",
            prompts,
            HeadTraining(**settings, templates=12, steps=0),
            work=tmp_path / "w2",
            resume=True,
            log=quiet,
            progress=False,
        )
    with pytest.raises(
        DraftVerifyError, match="make-draft --kind head"
    ):  # another target's head, refused before any data
        build_head(
            tiny("llama", seed=5, layers=2),
            tmp_path / "d",
            prompts,
            HeadTraining(**settings, steps=0),
            work=tmp_path / "w3",
            init=out,
            log=quiet,
            progress=False,
        )
    assert not (tmp_path / "w3" / "features" / "heldout.pt").exists()


def test_head_width_fits_the_shipping_budget_and_a_narrow_head_drafts_exactly(built, tmp_path):
    """A 1.5B-shaped target's head gets a narrower MLP: its fp16 weights and its acceptance head fit the package's
    budget (a small target keeps its own width); a head built narrow saves, loads with its width and drafts
    losslessly."""
    from types import SimpleNamespace

    from draftverify.tools.make_draft.feature_settings import PACKAGE_BYTES, PACKAGE_SLACK, head_width

    big = SimpleNamespace(
        hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128, intermediate_size=8960
    )
    width = head_width(big)
    assert 64 <= width < 8960 and width % 64 == 0
    h = 1536
    params = 2 * h * h + 2 * h * 12 * 128 + 2 * h * 2 * 128 + 3 * h * width
    room = PACKAGE_BYTES - PACKAGE_SLACK - 4 * (h * h + 2 * h + 1)  # less the acceptance head
    assert params * 2 <= room < (params + 3 * h * 64) * 2  # the widest that fits
    assert head_width(SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=128)) == 128
    assert head_width(big, asked=100) == 100

    target, _, prompts, _ = built
    settings = {**TINY, "width": 16, "steps": 2, "epochs": 1}
    build_head(target, tmp_path / "narrow", prompts, HeadTraining(**settings), log=quiet, progress=False)
    head = FeatureHead.load(tmp_path / "narrow")
    assert head.config.intermediate_size == 16 and head.down.weight.shape[1] == 16
    engine = Engine(target, load_draft(str(tmp_path / "narrow"), target))
    ids = engine.encode("apple river 3", chat=True)
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=20, eos_token_id=[])
    assert engine.generate(ids, method="speculative", max_new_tokens=20, eos_token_id=[]).tokens == ar.tokens
