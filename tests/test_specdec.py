"""SpecDec++: the acceptance head, its training data and training, the stopping rule, the method's
exactness (greedy and sampling), and refusal of head files that are corrupt or for another pair."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCHS
from phrase_sampling import broken_rule
from scipy.stats import chisquare
from test_feature_head import random_head as random_feature_head

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadPolicy, load_head, save_head
from draftverify.errors import DraftVerifyError
from draftverify.feature_head_cache import HeadCache
from draftverify.loading import Loaded
from draftverify.models import Runner
from draftverify.prompt_files import read_prompts
from draftverify.sampling import Sampling
from draftverify.tools.acceptance_data import (
    Examples,
    acceptance_labels,
    label_head_chains,
    label_responses,
    mix_tokens,
)
from draftverify.tools.acceptance_fit import TrainSettings, calibration, fit_head, weighted_bce
from draftverify.tools.train_acceptance_head import SHIPPED_PROMPTS, train_acceptance_head


def random_head(path: Path, target: Loaded, draft: Loaded, depth: int = 1, seed: int = 0) -> Path:
    """An untrained head for the pair: its predictions vary with the hidden state, so draft lengths vary."""
    torch.manual_seed(seed)
    head = AcceptanceHead(draft.model.config.hidden_size, depth)
    return save_head(path, head, draft.identity, target.identity)


def scripted_head(hidden_size: int = 1) -> AcceptanceHead:
    """D = 0, weight e_0, bias 0: p_hat = sigmoid(e[0]), so a hidden state [logit(p)] scripts p_hat = p."""
    head = AcceptanceHead(hidden_size, depth=0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.weight[0, 0] = 1.0
        head.out.bias.zero_()
    return head


def logit(p: float) -> torch.Tensor:
    return torch.tensor([math.log(p / (1 - p))])


def noisy_copy(model: Loaded, scale: float, seed: int = 5) -> Loaded:
    """The target with noise on its matrices: a draft that agrees with it part of the time."""
    m = copy.deepcopy(model.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return Loaded(m, model.tokenizer, f"{model.name}+noise")


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
    from draftverify.models import Runner

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
    from draftverify.models import Runner
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


# -- the stopping rule ----------------------------------------------------------------------


def run_round(policy: AcceptanceHeadPolicy, p_hats: list[float]) -> int:
    """Drive one drafting round as `speculative` does; p_hats[i] scripts the head's p_hat for draft i+1.
    Returns the number of drafted tokens."""
    hiddens = [logit(0.5)] + [logit(p) for p in p_hats]  # the first state reads the last accepted token
    for n in range(1, policy.max_length() + 1):
        if not policy.keep_drafting(n, torch.zeros(3), hiddens[n - 1]):
            return n
    return policy.max_length()


def test_stopping_rule_on_scripted_probabilities():
    head = scripted_head()
    # 1 - prod: after draft 1: 0.1, after 2: 0.19, after 3: 0.595 > 0.3 -> the 4th draft (already sampled) is the last
    assert run_round(AcceptanceHeadPolicy(head, h=0.3, cap=20), [0.9, 0.9, 0.5, 0.9]) == 4
    assert run_round(AcceptanceHeadPolicy(head, h=0.6, cap=20), [0.9, 0.9, 0.5, 0.9, 0.9]) == 5
    # a head that expects a rejection right away stops after two drafts (the paper's Algorithm 2)
    assert run_round(AcceptanceHeadPolicy(head, h=0.5, cap=20), [0.01] * 30) == 2
    # the hard cap
    assert run_round(AcceptanceHeadPolicy(head, h=0.9, cap=20), [0.9999] * 30) == 20
    assert run_round(AcceptanceHeadPolicy(head, h=0.9, cap=1), [0.01] * 30) == 1


def test_stopping_rule_resets_every_round():
    policy = AcceptanceHeadPolicy(scripted_head(), h=0.3, cap=20)
    assert run_round(policy, [0.5] * 10) == 2
    assert run_round(policy, [0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95]) == 8  # 1 - 0.95^7 = 0.30 > 0.3
    with pytest.raises(DraftVerifyError):
        AcceptanceHeadPolicy(scripted_head(), h=1.0)


def test_policy_sets_the_draft_lengths_in_the_method(tiny, tmp_path):
    target, draft = tiny("llama"), tiny("llama", seed=1, layers=2)
    engine = Engine(target, draft)
    lengths = {}
    for name, bias in (("pessimist", -20.0), ("optimist", 20.0)):
        head = AcceptanceHead(draft.model.config.hidden_size, 0)
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(bias)
        path = save_head(tmp_path / f"{name}.safetensors", head, draft.identity, target.identity)
        stats = engine.generate(
            "Hello", method="specdec-pp", max_new_tokens=30, eos_token_id=[], head=str(path), h=0.5, cap=6
        ).stats
        lengths[name] = (stats.drafted, len(stats.steps))
    drafted, rounds = lengths["pessimist"]
    assert 2 * rounds - 3 <= drafted <= 2 * rounds  # two per round (fewer only in the last two, where the output ends)
    drafted, rounds = lengths["optimist"]
    assert drafted > 4.5 * rounds  # the cap, 6 per round (fewer only where the output ends)


# -- exactness ------------------------------------------------------------------------------


def assert_equals_autoregressive(engine: Engine, head: Path, *label):
    """`specdec-pp` with `head`, at two settings, gives autoregressive decoding's tokens on two prompts; returns
    its last output."""
    for prompt in ["Hello there, how", "def f(x):\n    return"]:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=32, eos_token_id=[])
        for options in ({"h": 0.2}, {"h": 0.8, "cap": 3}):
            out = engine.generate(
                ids, method="specdec-pp", max_new_tokens=32, eos_token_id=[], head=str(head), **options
            )
            assert out.tokens == ar.tokens, (*label, prompt, options)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_kind", ["random", "self"])
def test_greedy_equals_autoregressive(tiny, tmp_path, arch, draft_kind):
    target = tiny(arch, seed=0)
    draft = tiny(arch, seed=1, layers=2) if draft_kind == "random" else target
    path = random_head(tmp_path / "head.safetensors", target, draft)
    out = assert_equals_autoregressive(Engine(target, draft), path, arch, draft_kind)
    if draft_kind == "self":
        assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_ouroboros_with_the_head_is_exact_and_stops_by_it(tiny, tmp_path, arch):
    target, draft = tiny(arch, seed=0), tiny(arch, seed=1, layers=2)
    engine = Engine(target, draft)
    path = random_head(tmp_path / "head.safetensors", target, draft)
    ids = engine.encode("Hello there, how")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[])
    for options in ({"h": 0.2}, {"h": 0.8, "cap": 5}):
        out = engine.generate(ids, method="ouroboros-pp", max_new_tokens=40, eos_token_id=[], head=str(path), **options)
        assert out.tokens == ar.tokens, (arch, options)
    for name, bias, most in (("pessimist", -20.0, 2), ("optimist", 20.0, 6)):
        head = AcceptanceHead(draft.model.config.hidden_size, 0)
        with torch.no_grad():
            head.out.bias.fill_(bias)
            head.out.weight.zero_()
        path = save_head(tmp_path / f"{name}.safetensors", head, draft.identity, target.identity)
        stats = engine.generate(
            ids, method="ouroboros-pp", max_new_tokens=40, eos_token_id=[], head=str(path), cap=6, reuse=False
        ).stats
        rounds = len(stats.steps)
        assert stats.extra["draft_tokens"] <= most * rounds
        if name == "optimist":
            assert stats.extra["draft_tokens"] > 4 * rounds


def second_token_pvalue(engine: Engine, target: Loaded, head: Path, n: int) -> float:
    """Chi-square p-value of the second new token (the first that goes through verification)
    against the target's exact marginal sum_x1 p(x1) p(x2 | x1); rare tokens are pooled."""
    prompt = [5, 6, 7]
    sampling = Sampling(temperature=1.0, top_k=8)
    with torch.no_grad():
        p1 = sampling.probs(target.model(torch.tensor([prompt])).logits[0, -1]).double()
        p2 = torch.zeros_like(p1)
        for x1 in p1.nonzero().flatten().tolist():
            p2 += p1[x1] * sampling.probs(target.model(torch.tensor([prompt + [x1]])).logits[0, -1]).double()
    counts = torch.zeros_like(p2)
    for seed in range(n):
        out = engine.generate(
            prompt,
            method="specdec-pp",
            max_new_tokens=3,
            temperature=1.0,
            top_k=8,
            seed=seed,
            eos_token_id=[],
            head=str(head),
            h=0.5,
            cap=4,
        )
        counts[out.tokens[1]] += 1
    expected = p2 * n
    big = expected >= 5
    observed, rest = counts[big].numpy(), expected[~big].sum().item()
    assert counts[expected == 0].sum() == 0, "a token the target never samples was emitted"
    if rest > 0:  # pool the rare tokens into one cell (none when every possible token is common)
        observed = np.append(observed, counts[~big].sum().item())
    expected = expected[big].numpy() if rest == 0 else np.append(expected[big].numpy(), rest)
    return chisquare(observed, expected / expected.sum() * observed.sum()).pvalue


def test_sampling_matches_the_target_distribution(tiny, tmp_path, monkeypatch):
    target = tiny("llama", seed=0, layers=2, hidden=32)
    draft = tiny("llama", seed=3, layers=1, hidden=32)
    head = random_head(tmp_path / "head.safetensors", target, draft, seed=2)
    engine = Engine(target, draft)
    assert second_token_pvalue(engine, target, head, 3000) > 1e-3
    # the same test catches a broken acceptance rule with the policy on
    broken_rule(monkeypatch)  # on rejection, resample from p instead of norm(max(p - q, 0))
    assert (
        second_token_pvalue(engine, target, head, 5000) < 1e-4
    )  # more samples: the broken rule is only slightly off here


# -- over a feature head ----------------------------------------------------------------------


def feature_head_engine(tiny, tmp_path, bias: float | None = None, seed: int = 1):
    """A tiny target with a random feature head as its draft, and an acceptance head made for that head: random
    (bias None) or one that always predicts sigmoid(bias)."""
    target = tiny("llama", seed=0)
    feature = random_feature_head(target, seed=seed)
    head = AcceptanceHead(target.model.config.hidden_size, 0 if bias is not None else 1)
    if bias is not None:
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(bias)
    path = save_head(tmp_path / f"over-head-{bias}.safetensors", head, feature.identity, target.identity)
    return Engine(target, feature), target, feature, path


def test_over_a_feature_head_greedy_equals_autoregressive_and_the_head_sets_the_lengths(tiny, tmp_path):
    engine, target, feature, path = feature_head_engine(tiny, tmp_path)
    assert_equals_autoregressive(engine, path)
    for bias, per_round in ((-20.0, 1), (20.0, 6)):  # every draft judged, the first too: 1 or the cap a round
        engine, *_, path = feature_head_engine(tiny, tmp_path, bias)
        stats = engine.generate(
            "Hello", method="specdec-pp", max_new_tokens=40, eos_token_id=[], head=str(path), cap=6
        ).stats
        rounds = len(stats.steps)
        # fewer only in the last rounds, where less room is left than the cap
        assert per_round * (rounds - per_round - 1) <= stats.drafted <= per_round * rounds


def test_over_a_feature_head_the_model_drafts_when_asked_and_heads_are_not_mixed_up(tiny, tmp_path):
    engine, target, feature, path = feature_head_engine(tiny, tmp_path)
    draft = tiny("llama", seed=1, layers=2)
    for_model = random_head(tmp_path / "model.safetensors", target, draft)
    both = Engine(target, draft, feature_head=feature)
    ids = both.encode("Hello there")
    ar = both.generate(ids, method="autoregressive", max_new_tokens=16, eos_token_id=[]).tokens
    assert both.generate(ids, method="specdec-pp", max_new_tokens=16, eos_token_id=[], head=str(path)).tokens == ar
    model = both.generate(
        ids, method="specdec-pp", max_new_tokens=16, eos_token_id=[], head=str(for_model), drafter="model"
    )
    assert model.tokens == ar
    with pytest.raises(DraftVerifyError, match="trained for another draft"):  # the model's head on the feature head
        both.generate(ids, method="specdec-pp", max_new_tokens=4, head=str(for_model))
    with pytest.raises(DraftVerifyError, match="drafter='tree'"):
        both.generate(ids, method="specdec-pp", max_new_tokens=4, drafter="tree")


def test_over_a_feature_head_the_labelled_inputs_are_what_drafting_reads(tiny):
    """Each labelled draft of `label_head_chains` is replayed through the head's own KV cache, as the drafter
    drafts it: the same predicted feature, and the label says whether the draft is the answer's token."""
    target = tiny("llama", seed=0)
    feature = random_feature_head(target, seed=1)
    engine = Engine(target, feature)
    prompt = engine.encode("Hello there, how")
    runner = Runner(target.model)
    answer = []  # mostly the head's own first drafts, so that chains run on: labels of every depth, right and wrong
    for i in range(24):
        seq = prompt + answer
        runner.reset()
        features = runner.forward(seq, last=len(seq), hidden=True).hidden
        cache = HeadCache(feature, capacity=len(seq) + 8)
        guess = int(
            feature.vocab[
                feature.logits(cache.forward(features[:-1], torch.tensor(seq[1:]), range(len(seq) - 1))[-1]).argmax()
            ]
        )
        answer.append(guess if i % 4 else (guess + 1) % feature.vocab.numel())
    examples = label_head_chains(runner, feature, [prompt], [answer], Sampling(), depth=4, vocab=0, progress=False)
    seq = prompt + answer
    runner.reset()
    out = runner.forward(seq, last=len(seq), hidden=True)
    features, law = out.hidden, Sampling(temperature=1.0).probs(out.logits)  # law[t]: the target's after token t
    replayed = {d: ([], [], []) for d in range(1, 5)}
    for root in range(len(prompt) - 2, len(seq) - 2):  # input position r drafts token r + 2 first
        cache = HeadCache(feature, capacity=len(seq) + 8)
        produced = cache.forward(features[: root + 1], torch.tensor(seq[1 : root + 2]), range(root + 1))[-1]
        for d in range(1, 5):
            if root + 1 + d >= len(seq):
                break
            draft = int(feature.vocab[feature.logits(produced).argmax()])
            replayed[d][0].append(produced)
            replayed[d][1].append(float(draft == seq[root + 1 + d]))
            replayed[d][2].append(law[root + d, draft].item())
            if draft != seq[root + 1 + d]:
                break
            produced = cache.forward(produced[None], torch.tensor([draft]), [root + d])[0]
    want_features = torch.cat([torch.stack(f) for f, _, _ in replayed.values() if f])
    want_labels = torch.tensor([x for _, labels, _ in replayed.values() for x in labels])
    assert torch.equal(examples.labels, want_labels)
    assert torch.allclose(examples.features, want_features, atol=1e-4)
    # under sampling settings a draft's label is the target's probability of it: a deterministic guess's acceptance
    sampled = label_head_chains(runner, feature, [prompt], [answer], Sampling(temperature=1.0), 4, 0, progress=False)
    assert torch.equal(sampled.features, examples.features)
    want = torch.tensor([x for _, _, probs in replayed.values() for x in probs])
    assert torch.allclose(sampled.labels, want, atol=1e-6)
    assert 0 < examples.labels.mean() < 1 and len(replayed[3][0]) > 0  # right and wrong drafts, chains ran on


def test_over_a_feature_head_a_trained_head_loads_and_stays_exact(tiny, tmp_path):
    target = tiny("llama", seed=0)
    feature = random_feature_head(target, seed=1)
    prompts = [(f"Tell me about {w}.", False) for w in ("rivers", "stones", "clouds", "paper", "apples", "seven")]
    head = train_acceptance_head(
        target,
        feature,
        prompts,
        TrainSettings(epochs=2, holdout=0.2),
        max_new_tokens=12,
        answer_batch=3,
        progress=False,
    )
    assert head.settings["drafter"] == "feature head" and head.settings["report"]["train_positions"] > 0
    path = save_head(tmp_path / "trained.safetensors", head, feature.identity, target.identity)
    engine = Engine(target, feature)
    ids = engine.encode("Tell me about rivers.")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=24, eos_token_id=[])
    assert (
        engine.generate(ids, method="specdec-pp", max_new_tokens=24, eos_token_id=[], head=str(path)).tokens
        == ar.tokens
    )


def test_over_a_feature_head_sampling_matches_the_target_distribution(tiny, tmp_path):
    engine, target, feature, path = feature_head_engine(tiny, tmp_path)
    assert second_token_pvalue(engine, target, path, 2000) > 1e-3


# -- files ----------------------------------------------------------------------------------


def test_save_and_load_round_trip(tiny, tmp_path):
    target, draft = tiny("llama"), tiny("llama", seed=1, layers=2)
    head = AcceptanceHead(64, depth=2)
    head.settings = {"training": {"w_rej": 6.0}}
    path = save_head(tmp_path / "h.safetensors", head, draft.identity, target.identity)
    assert [p.name for p in tmp_path.iterdir()] == ["h.safetensors"]  # no temporary file left behind
    loaded = load_head(path, draft.identity, target.identity)
    assert loaded.depth == 2 and loaded.settings == head.settings
    assert loaded.trained_for == {"draft": draft.identity, "target": target.identity}
    e = torch.randn(64)
    assert loaded.accept_prob(e) == pytest.approx(head.accept_prob(e))


def test_head_for_another_pair_is_refused(tiny, tmp_path):
    target, draft, other = tiny("llama"), tiny("llama", seed=1, layers=2), tiny("llama", seed=2, layers=2)
    path = random_head(tmp_path / "h.safetensors", target, draft)
    with pytest.raises(DraftVerifyError, match="trained for another draft model"):
        load_head(path, other.identity, target.identity)
    with pytest.raises(DraftVerifyError, match="trained for another target model"):
        load_head(path, draft.identity, other.identity)
    with pytest.raises(DraftVerifyError, match="another draft model"):  # also through the method
        Engine(target, other).generate("Hi", method="specdec-pp", max_new_tokens=5, head=str(path))


def test_corrupt_head_files_are_refused(tiny, tmp_path):
    target, draft = tiny("llama"), tiny("llama", seed=1, layers=2)
    good = random_head(tmp_path / "good.safetensors", target, draft).read_bytes()
    cases = {
        "garbage": b"not a safetensors file at all",
        "truncated": good[: len(good) // 2],
        "empty": b"",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(DraftVerifyError, match="corrupt"):
            load_head(path, draft.identity, target.identity)
    from safetensors.torch import save_file

    save_file({"out.weight": torch.zeros(1, 64)}, tmp_path / "foreign.safetensors")
    with pytest.raises(DraftVerifyError, match="not a draftverify acceptance head"):
        load_head(tmp_path / "foreign.safetensors")
    # settings that disagree with the weights (hidden size) are refused too
    head = AcceptanceHead(64, 1)
    save_head(tmp_path / "odd.safetensors", head, draft.identity, target.identity)
    with open(tmp_path / "odd.safetensors", "rb") as fh:
        raw = fh.read()
    (tmp_path / "odd.safetensors").write_bytes(raw.replace(b'"hidden_size":"64"', b'"hidden_size":"65"'))
    with pytest.raises(DraftVerifyError, match="corrupt"):
        load_head(tmp_path / "odd.safetensors")
    with pytest.raises(DraftVerifyError, match="does not exist"):
        load_head(tmp_path / "missing.safetensors")


def test_unknown_shipped_head_name_is_refused(tiny):
    engine = Engine(tiny("llama"), tiny("llama", seed=1, layers=2))
    with pytest.raises(DraftVerifyError, match="no shipped acceptance head named 'nope'"):
        engine.generate("Hi", method="specdec-pp", max_new_tokens=5, head="nope")


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


# -- the Pareto view of a bench run ------------------------------------------------------------


def bench_record(label, prompt, dataset, wall, tokens, target, drafted, accepted):
    return {
        "label": label,
        "prompt_id": prompt,
        "repeat": 0,
        "dataset": dataset,
        "category": dataset,
        "wall_s": wall,
        "new_tokens": tokens,
        "target_forwards": target,
        "draft_forwards": drafted,
        "drafted": drafted,
        "accepted": accepted,
        "draft_s": 0.1,
        "verify_s": 0.1,
        "ttft_s": 0.1,
        "token_times": [0.1] * tokens,
        "steps": [],
        "peak_mem_bytes": 1,
    }


def test_pareto_view_of_a_bench_run(tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app
    from draftverify.tools.pareto import frontier, pareto_tables

    assert frontier([(1, 1), (2, 0.5), (2, 2), (0.5, 3), (1, 1)]) == [True, True, False, True, True]
    # (label, target forwards, drafted, accepted) for 10 tokens on each of two data sets
    methods = [
        ("autoregressive", 10, 0, 0),
        ("speculative[k=2]", 5, 10, 5),
        ("speculative[k=8]", 3, 24, 7),
        ("specdec-pp:h0.3", 4, 8, 6),
        ("specdec-pp[h=0.9,head=wrej3]", 3, 30, 7),
    ]
    records = [
        bench_record(label, f"{d}-1", d, 1.0, 10, t, dr, a)
        for d in ("humaneval", "spec_bench")
        for label, t, dr, a in methods
    ]
    results = {"baseline": "autoregressive", "methods": [{"label": m[0]} for m in methods], "records": records}
    tables = pareto_tables(results)
    assert set(tables) == {"all", "humaneval", "spec_bench"}
    rows = {r["label"]: r for r in tables["humaneval"]}
    assert "autoregressive" not in rows
    assert rows["speculative[k=2]"]["verification_rate"] == pytest.approx(0.5) and rows["speculative[k=2]"][
        "discard_rate"
    ] == pytest.approx(0.5)
    # specdec-pp h0.3 (0.4, 0.2) beats k=2 (0.5, 0.5); k=8 (0.3, 1.7) beats the wrej3 head's (0.3, 2.3)
    assert {label for label, r in rows.items() if r["frontier"]} == {"specdec-pp:h0.3", "speculative[k=8]"}
    assert (
        rows["specdec-pp[h=0.9,head=wrej3]"]["series"] == "specdec-pp[head=wrej3]"
        and rows["speculative[k=8]"]["series"] == "speculative"
    )
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    result = CliRunner().invoke(app, ["pareto", str(path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "pareto.png").stat().st_size > 0 and "| `specdec-pp:h0.3` | 0.400 | 0.200 |" in (
        tmp_path / "pareto.md"
    ).read_text()
    path.write_text('{"records": []}')
    assert "is not a bench results.json" in str(CliRunner().invoke(app, ["pareto", str(path)]).exception)


def test_specdec_plus_plus_is_another_name_of_the_method():
    from draftverify.methods import METHODS
    from draftverify.methods.specdec_pp import SpecDecPP

    assert METHODS["specdec++"] is METHODS["specdec-pp"] is SpecDecPP
    assert all(cls.name == name or name in cls.aliases for name, cls in METHODS.items())


@pytest.mark.parametrize("method", ["specdec-pp", "speculative", "self-speculative"])
def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_exact(tiny, tmp_path, monkeypatch, method):
    """FR-Spec for a draft model and a layer-skip draft (`Method.draft_vocab`): every drafted token is one of the
    vocabulary's, and the output is still autoregressive decoding's, greedy."""
    from draftverify.drafters.draft_model import DraftModel
    from draftverify.methods.base import Method

    target, draft = tiny("llama", seed=0), tiny("llama", seed=0, layers=2)
    vocab = torch.arange(0, target.model.config.vocab_size, 2)  # every even token id
    monkeypatch.setattr(Method, "draft_vocab", lambda self, n: vocab[:n] if n else None)
    drafted, chain = [], DraftModel.chain

    def spy(self, s, feed, k):
        out = chain(self, s, feed, k)
        drafted.extend(out[0])
        return out

    monkeypatch.setattr(DraftModel, "chain", spy)
    path = random_head(tmp_path / "head.safetensors", target, draft)
    engine = Engine(target, draft, backend="static")
    options = {
        "specdec-pp": {"head": str(path), "h": 0.9},
        "speculative": {"policy": "constant", "k": 4},
        "self-speculative": {"strategy": "heuristic", "vocab": 16},  # its default drafts from the whole head
    }[method]
    for prompt in ["Hello there, how", "def f(x):\n    return"]:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=24, eos_token_id=[])
        out = engine.generate(ids, method=method, max_new_tokens=24, eos_token_id=[], **options)
        assert out.tokens == ar.tokens, (method, prompt)
    assert drafted and all(t % 2 == 0 for t in drafted), method


def test_drafting_from_a_vocabulary_samples_the_target_distribution(tiny, monkeypatch):
    """Sampling from a draft vocabulary (q is zero outside it) stays exact: the second token, the first verified,
    follows the target's law; the classic wrong rule (resample from p after a rejection) is caught."""
    from phrase_sampling import second_token_pvalue as law_pvalue

    from draftverify.methods.base import Method

    target = tiny("llama", seed=0, layers=2, hidden=32)
    draft = tiny("llama", seed=3, layers=1, hidden=32)
    vocab = torch.arange(0, target.model.config.vocab_size, 2)  # every even token id
    monkeypatch.setattr(Method, "draft_vocab", lambda self, n: vocab[:n] if n else None)
    engine, prompt, sampling = Engine(target, draft), [5, 6, 7], Sampling(temperature=1.0, top_k=8)

    def pvalue(n: int) -> float:
        counts: dict[int, int] = {}
        for seed in range(n):
            out = engine.generate(
                prompt, method="speculative", max_new_tokens=3, temperature=1.0, top_k=8, seed=seed,
                eos_token_id=[], policy="constant", k=2,
            )  # fmt: skip
            counts[out.tokens[1]] = counts.get(out.tokens[1], 0) + 1
        return law_pvalue(target.model, prompt, sampling, counts)

    assert pvalue(2000) > 1e-3
    broken_rule(monkeypatch)
    assert pvalue(2000) < 1e-4
