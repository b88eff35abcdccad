"""SpecDec++ over a feature head: greedy and sampled output equal the target's, the head sets the draft lengths, a
head trained on the feature head's drafts loads and stays exact, and the model drafts when asked."""

from __future__ import annotations

import pytest
import torch
from acceptance_heads import (
    assert_equals_autoregressive,
    random_head,
    second_token_pvalue,
)
from test_feature_head import random_head as random_feature_head

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, save_head
from draftverify.errors import DraftVerifyError
from draftverify.feature_head_cache import HeadCache
from draftverify.models import Runner
from draftverify.sampling import Sampling
from draftverify.tools.acceptance_data import (
    label_head_chains,
)
from draftverify.tools.acceptance_fit import TrainSettings
from draftverify.tools.train_acceptance_head import train_acceptance_head

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
