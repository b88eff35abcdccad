"""SpecDec++: the stopping rule, the method's exactness (greedy and sampling), and refusal of head files that are
corrupt or for another pair. The head's training data and training: test_specdec_training.py; the method over a
feature head: test_specdec_feature_head.py."""

from __future__ import annotations

import pytest
import torch
from acceptance_heads import (
    assert_equals_autoregressive,
    logit,
    random_head,
    scripted_head,
    second_token_pvalue,
)
from conftest import ARCHS
from phrase_sampling import broken_rule

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadPolicy, load_head, save_head
from draftverify.errors import DraftVerifyError

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


def test_specdec_plus_plus_is_another_name_of_the_method():
    from draftverify.methods import METHODS
    from draftverify.methods.specdec_pp import SpecDecPP

    assert METHODS["specdec++"] is METHODS["specdec-pp"] is SpecDecPP
    assert all(cls.name == name or name in cls.aliases for name, cls in METHODS.items())
