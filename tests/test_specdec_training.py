"""SpecDec++'s acceptance head: its architecture, its training data (labels, mixing, prompts), its loss and
calibration, training on a tiny pair (cached, resumable, seeded), and the `train-acceptance-head` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from acceptance_heads import (
    noisy_copy,
)

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, load_head
from draftverify.errors import DraftVerifyError
from draftverify.models import Runner
from draftverify.prompt_files import read_prompts
from draftverify.sampling import Sampling
from draftverify.tools.acceptance_data import (
    Examples,
    acceptance_labels,
    label_responses,
    mix_tokens,
)
from draftverify.tools.acceptance_fit import TrainSettings, calibration, fit_head, weighted_bce
from draftverify.tools.train_acceptance_head import SHIPPED_PROMPTS, train_acceptance_head

# -- the head ------------------------------------------------------------------------------


def test_head_architecture():
    linear = AcceptanceHead(16, depth=0)
    assert sum(p.numel() for p in linear.parameters()) == 16 + 1
    deep = AcceptanceHead(16, depth=3)
    assert len(deep.blocks) == 3 and len({id(b.linear.weight) for b in deep.blocks}) == 3  # distinct blocks
    assert deep(torch.randn(5, 16)).shape == (5,)
    e = torch.randn(16)
    assert 0 < deep.accept_prob(e) < 1
    assert deep.accept_prob(e.half()) == pytest.approx(deep.accept_prob(e), abs=1e-2)  # any dtype in
    with pytest.raises(DraftVerifyError):
        AcceptanceHead(16, depth=-1)


# -- labels, mixing, loss, calibration --------------------------------------------------------


def test_acceptance_labels_on_hand_made_distributions():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.25, 0.6, 0.15], [0.2, 0.7, 0.1], [0.5, 0.5, 0.0]])
    y = torch.tensor([0, 1, 0])
    # min(1, 0.5/0.25) = 1; 0.1/0.7; 0/0.5 = 0
    assert acceptance_labels(p, q, y).tolist() == pytest.approx([1.0, 0.1 / 0.7, 0.0])
    y = torch.tensor([1, 2, 1])
    assert acceptance_labels(p, q, y).tolist() == pytest.approx([0.5, 1.0, 1.0])
    # greedy settings make p and q one-hot: the label says whether the argmaxes agree
    greedy = Sampling()
    pg, qg = (
        greedy.probs(torch.tensor([[1.0, 5.0, 2.0], [3.0, 0.0, 1.0]])),
        greedy.probs(torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 4.0]])),
    )
    yg = qg.argmax(-1)
    assert acceptance_labels(pg, qg, yg).tolist() == [1.0, 0.0]


def test_label_is_the_acceptance_probability_of_the_verifier():
    """Averaged over Y ~ q, the label equals the verifier's acceptance rate sum_x min(p(x), q(x))."""
    p, q = torch.tensor([0.3, 0.05, 0.25, 0.4]), torch.tensor([0.05, 0.4, 0.1, 0.45])
    expected = torch.minimum(p, q).sum().item()
    all_y = torch.arange(4)
    mean_label = (q * acceptance_labels(p.expand(4, 4), q.expand(4, 4), all_y)).sum().item()
    assert mean_label == pytest.approx(expected)


def test_mix_tokens():
    x, y = torch.arange(10_000), -torch.arange(1, 10_001)
    z, from_draft = mix_tokens(x, y, 0.3, torch.Generator().manual_seed(0))
    assert torch.equal(z[from_draft], y[from_draft]) and torch.equal(z[~from_draft], x[~from_draft])
    assert abs((~from_draft).float().mean().item() - 0.3) < 0.02  # a fraction r keeps the target's token
    z0, all_draft = mix_tokens(x, y, 0.0, torch.Generator().manual_seed(0))
    assert all_draft.all() and torch.equal(z0, y)
    _, again = mix_tokens(x, y, 0.3, torch.Generator().manual_seed(0))
    assert torch.equal(again, from_draft)  # seeded


def test_weighted_bce():
    logits, labels = torch.tensor([0.0, 2.0, -1.0]), torch.tensor([1.0, 0.0, 0.5])
    plain = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    assert weighted_bce(logits, labels, 1.0, 1.0).item() == pytest.approx(plain.item())
    # hand computation with w_rej = 6
    s = torch.nn.functional.softplus
    num = 1 * s(-logits[0]) + 6 * s(logits[1]) + (0.5 * s(-logits[2]) + 6 * 0.5 * s(logits[2]))
    assert weighted_bce(logits, labels, 1.0, 6.0).item() == pytest.approx((num / (1 + 6 + 0.5 + 3)).item())
    # a larger reject weight pulls the best constant prediction down
    best = {
        w: max(torch.linspace(-4, 4, 801), key=lambda c: -weighted_bce(c.expand(3), labels, 1.0, w).item()).item()
        for w in (1.0, 6.0)
    }
    assert best[6.0] < best[1.0]


def test_calibration():
    p_hat = torch.tensor([0.05, 0.05, 0.95, 0.95])
    ece, bins = calibration(p_hat, torch.tensor([0.05, 0.05, 0.95, 0.95]))
    assert ece == pytest.approx(0.0, abs=1e-6) and [b["count"] for b in bins] == [2, 2]
    ece, _ = calibration(p_hat, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert ece == pytest.approx(0.95)


# -- training -----------------------------------------------------------------------------


def test_fit_head_learns_a_known_rule():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(4000, 8, generator=g)
    labels = torch.sigmoid(3 * e[:, 0] - 2 * e[:, 1])
    examples = Examples(e, labels, torch.arange(4000) // 20)
    head, report = fit_head(examples, TrainSettings(depth=1, epochs=20, w_rej=1.0, lr=1e-2), progress=False)
    held = report["heldout"]
    assert report["history"][-1]["train_weighted_bce"] < report["history"][0]["train_weighted_bce"]
    assert held["bce"] < held["bce_constant"] - 0.2 and held["ece"] < 0.1
    assert report["heldout_responses"] == 20 and report["train_responses"] == 180  # split by response


def test_head_trains_on_a_tiny_pair(tiny):
    target = tiny("llama", seed=0, layers=2, hidden=32)
    draft = noisy_copy(target, 0.5)
    prompts = [
        (f"{w} {i}", False) for i, w in enumerate(["cats", "dogs", "rain", "sun", "code", "tea", "maps", "wind"] * 3)
    ]
    head = train_acceptance_head(
        target,
        draft,
        prompts,
        TrainSettings(depth=1, epochs=10, batch_size=32, w_rej=1.0),
        Sampling(),
        max_new_tokens=24,
        answer_batch=24,
        progress=False,
    )
    report = head.settings["report"]
    losses = [row["train_weighted_bce"] for row in report["history"]]
    assert losses[-1] < 0.9 * losses[0]
    assert 0 < report["train_mean_label"] < 1  # both outcomes occur
    assert head.settings["training"]["r"] == 0.15 and head.settings["sampling"]["temperature"] == 0.0


def test_labelled_positions_are_the_draft_positions(tiny):
    target = tiny("llama", seed=0, layers=2, hidden=32)

    prompts, answers = [[5, 6, 7], [8, 9]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]]
    # the target as its own draft: every draft sample is accepted (label 1), greedy or sampled
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        ex = label_responses(
            Runner(target.model), Runner(target.model), prompts, answers, sampling, r=0.0, seed=0, progress=False
        )
        assert len(ex.labels) == 9 and ex.features.shape == (9, 32)
        assert torch.allclose(ex.labels, torch.ones(9)) and ex.response.tolist() == [0] * 6 + [1] * 3
    # r close to 1 keeps almost every target token: few positions carry the loss
    ex = label_responses(
        Runner(target.model),
        Runner(tiny("llama", seed=1, layers=1, hidden=32).model),
        prompts,
        answers,
        Sampling(temperature=1.0),
        r=0.99,
        seed=0,
        progress=False,
    )
    assert len(ex.labels) <= 2


def test_answers_are_cached_and_resume_after_an_interruption(tiny, tmp_path, monkeypatch):
    from draftverify.tools.acceptance_data import answer_prompts

    target = tiny("llama", seed=0, layers=2, hidden=32)
    prompts = [[5, 6], [7, 8, 9], [10], [11, 12, 13, 14]]
    fresh = answer_prompts(target, prompts, 6, Sampling(), (0,), batch_size=2, progress=False)
    real, calls = target.model.generate, []

    def interrupted_after_one_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target.model, "generate", interrupted_after_one_batch)
    with pytest.raises(KeyboardInterrupt):
        answer_prompts(target, prompts, 6, Sampling(), (0,), batch_size=2, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("answers-*.partial.json"))) == 1
    calls.clear()
    monkeypatch.setattr(target.model, "generate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert (
        answer_prompts(target, prompts, 6, Sampling(), (0,), batch_size=2, cache_dir=tmp_path, progress=False) == fresh
    )
    assert len(calls) == 1  # only the missing batch was generated
    assert not list(tmp_path.glob("*.partial.json")) and len(list(tmp_path.glob("answers-*.json"))) == 1
    assert (
        answer_prompts(target, prompts, 6, Sampling(), (0,), batch_size=2, cache_dir=tmp_path, progress=False) == fresh
    )
    assert len(calls) == 1  # the finished answers come from the cache


def test_greedy_labels_need_no_target_forward(tiny):
    """With greedy answers and greedy settings, P_i = [Y_i == X_i]: the shortcut gives the same examples."""
    from draftverify.tools.acceptance_data import target_answers

    target = tiny("llama", seed=0, layers=2, hidden=32)
    draft = noisy_copy(target, 0.5)
    ids, answers = target_answers(
        target, [("cats", False), ("dogs and", False), ("a", True)], Sampling(), 16, answer_batch=3, progress=False
    )
    full = label_responses(Runner(target.model), Runner(draft.model), ids, answers, Sampling(), 0.3, 0, progress=False)
    short = label_responses(
        Runner(target.model), Runner(draft.model), ids, answers, Sampling(), 0.3, 0, progress=False, greedy_answers=True
    )
    assert torch.equal(full.labels, short.labels) and torch.equal(full.features, short.features)
    assert 0 < full.labels.mean() < 1


def test_training_is_seeded(tiny):
    g = torch.Generator().manual_seed(1)
    examples = Examples(torch.randn(600, 8, generator=g), torch.rand(600, generator=g), torch.arange(600) // 30)
    a, _ = fit_head(examples, TrainSettings(epochs=2), progress=False)
    b, _ = fit_head(examples, TrainSettings(epochs=2), progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_read_prompts(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hi", "chat": false}\n\n{"prompt": "there"}\n')
    assert read_prompts(jsonl) == [("hi", False), ("there", True)]
    txt = tmp_path / "p.txt"
    txt.write_text("one\ndef f():\\n    return\n")
    assert read_prompts(txt, chat=False) == [("one", False), ("def f():\n    return", False)]
    jsonl.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(DraftVerifyError, match="prompt field"):
        read_prompts(jsonl)
    jsonl.write_text('{"prompt": "  "}\n')
    with pytest.raises(DraftVerifyError, match="non-empty prompt"):
        read_prompts(jsonl)
    jsonl.write_text('{"prompt": "only one"}\n')
    with pytest.raises(DraftVerifyError, match="holds 1 prompts: this needs 2 or more"):
        read_prompts(jsonl, at_least=2)
    with pytest.raises(DraftVerifyError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_shipped_prompts_are_disjoint_from_the_benchmark_sets():
    import gzip

    rows = read_prompts(SHIPPED_PROMPTS)
    assert len(rows) >= 300
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not data.is_dir():
        pytest.skip("benchmark data folder ../shared/data not present")
    bench = []
    for path in data.rglob("*.jsonl*"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                bench += [row[k] for k in ("prompt",) if isinstance(row.get(k), str)] + [
                    t for t in row.get("turns", []) if isinstance(t, str)
                ]
    bench_text = "\n".join(bench)
    assert bench
    for prompt, _ in rows:
        assert prompt not in bench_text, prompt  # no training prompt is (part of) a benchmark prompt


# -- the command ----------------------------------------------------------------------------


def test_train_acceptance_head_command(tiny, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target = tiny("llama", seed=0, layers=2, hidden=32)
    folders = {}
    for name, loaded in (("target", target), ("draft", noisy_copy(target, 0.5))):
        folders[name] = tmp_path / name
        loaded.model.save_pretrained(folders[name])
        loaded.tokenizer.save_pretrained(folders[name])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"tell me about {w}" for w in ["cats", "dogs", "rain", "sun", "tea", "maps"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "heads" / "h.safetensors"
    args = [
        "train-acceptance-head",
        "--target",
        str(folders["target"]),
        "--draft",
        str(folders["draft"]),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--epochs",
        "3",
        "--max-new-tokens",
        "12",
        "--depth",
        "0",
        "--w-rej",
        "3",
        "--holdout",
        "0.2",
        "--device",
        "cpu",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert out.is_file() and out.with_suffix(".md").is_file()
    assert "Held-out" in out.with_suffix(".md").read_text()
    assert list((tmp_path / "cache" / "draftverify" / "specdec").glob("answers-*.json"))  # cached for the next run
    from draftverify.loading import load_model

    t, d = load_model(folders["target"], device="cpu"), load_model(folders["draft"], device="cpu")
    head = load_head(out, d.identity, t.identity)
    assert head.depth == 0 and head.settings["training"]["w_rej"] == 3.0
    assert (
        Engine(t, d).generate([5, 6, 7], method="specdec-pp", max_new_tokens=10, eos_token_id=[], head=str(out)).tokens
        == Engine(t, d).generate([5, 6, 7], method="autoregressive", max_new_tokens=10, eos_token_id=[]).tokens
    )


def test_the_old_train_head_name_still_runs_but_is_hidden():
    from typer.testing import CliRunner

    from draftverify.cli import app

    listing = CliRunner().invoke(app, ["--help"]).output
    assert "train-acceptance-head" in listing and "train-head " not in listing
    old = CliRunner().invoke(app, ["train-head", "--help"])
    assert old.exit_code == 0 and "acceptance head" in old.output
