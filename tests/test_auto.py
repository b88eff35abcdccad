"""`auto`: switching drafters round by round is lossless, sampling keeps the target's law, its options are
checked, and it says who drafted what."""

from __future__ import annotations

import pytest
import torch
from phrase_sampling import broken_rule, second_token_pvalue
from test_auto_choices import fixed_costs
from test_feature_head import random_head

from draftverify import Engine
from draftverify.drafters.auto import AR, AutoDrafter
from draftverify.drafters.auto_figures import CandidateRecord, Figures
from draftverify.drafters.base import Drafter, Proposal
from draftverify.drafters.draft_model import DraftModel
from draftverify.drafters.feature import FeatureHeadDrafter
from draftverify.errors import DraftVerifyError
from draftverify.loading import truncated_copy
from draftverify.models import Runner
from draftverify.policies import ConstantK
from draftverify.round import decode
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping

ALL = "head+draft+context+lookup"


@pytest.fixture(scope="module")
def engine(tiny):
    target = tiny("llama", layers=2)
    return Engine(target, truncated_copy(target, 1), feature_head=random_head(target, seed=2))


@pytest.mark.parametrize("backend", ["static", "eager"])
def test_auto_is_lossless_while_it_switches(tiny, backend):
    target = tiny("llama", layers=2)
    engine = Engine(target, truncated_copy(target, 1), backend=backend, feature_head=random_head(target, seed=2))
    used = set()
    for prompt in ("abc abc abc abc", "hello world, hello", "x"):
        ids = engine.encode(prompt, chat=True)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[])
        for options in ({}, {"use": ALL, "probe": 1}, {"use": "context"}):
            r = engine.generate(ids, method="auto", max_new_tokens=40, eos_token_id=[], **options)
            assert r.tokens == ar.tokens, (backend, prompt, options)
            chunks = r.stats.extra["auto_chunks"]
            assert sum(n for _, n in chunks) == len(r.tokens) - 1  # every round's tokens but the prefill's first
            used |= {who for who, _ in chunks}
    # (a free candidate drafts only where its scored offers pay)
    assert {"head", "draft", "context", AR} <= used <= {"head", "draft", "context", "lookup", AR}, used


class Guess(Drafter):
    """A free drafter that always offers the same guesses (deterministic: verified as one-hot)."""

    free = True

    def __init__(self, guesses: list[int]):
        self.guesses = guesses

    def propose(self, s, seq, room):
        return Proposal([[g] for g in self.guesses] if room > 0 else [])


def test_auto_sampling_matches_the_target(tiny, monkeypatch):
    """Rounds drafted by different candidates (a head's tree of guesses, a draft model's sampled chain, a free
    drafter's guesses) keep the target's law: the second token's distribution passes a
    chi-square test, and the wrong rule is caught."""
    target = tiny("llama", seed=0, layers=2, hidden=32)
    sampling, n, prompt = Sampling(temperature=1.0, top_k=6), 1200, [5, 9, 14]
    with torch.inference_mode():
        p1 = sampling.probs(target.model(torch.tensor([prompt])).logits[0, -1])
        p2 = sum(
            p1[x] * sampling.probs(target.model(torch.tensor([prompt + [x]])).logits[0, -1])
            for x in p1.nonzero().flatten().tolist()
        )
    runner, draft = (
        Runner(target.model),
        Runner(tiny("llama", seed=3, layers=1, hidden=32).model),
    )  # a draft that often disagrees
    head = random_head(target, seed=4, vocab=p2.topk(4).indices.tolist())
    records, first = {}, set()  # who drafted the round that gives the second token

    def pvalue():
        counts: dict[int, int] = {}
        for seed in range(n):
            s = Session(prompt, Sampling(temperature=1.0, top_k=6, seed=seed), Stopping(3, ()))
            candidates = {
                "head": FeatureHeadDrafter(head, runner, depth=2, nodes=6),
                "draft": DraftModel(draft, ConstantK(2)),
            }
            if seed % 4 in (1, 2):  # one candidate alone, or both, chosen by their figures
                candidates.pop("head" if seed % 4 == 1 else "draft")
            if seed % 4 == 3:  # one of them and a free one, on figures by which the free one pays
                candidates = {
                    "m": candidates["head" if seed // 4 % 2 else "draft"],
                    "guess": Guess(p2.topk(3).indices.tolist()[1:]),
                }
                auto = AutoDrafter(
                    candidates, fixed_costs(len(prompt)), Figures({"guess": CandidateRecord(accepted=4.0)}), probe=100
                )
            else:
                auto = AutoDrafter(
                    candidates, fixed_costs(len(prompt)), Figures(records), probe=0
                )  # 0: every round probes
            decode(s, runner, auto)
            counts[s.output[1]] = counts.get(s.output[1], 0) + 1
            first.add(s.stats.extra["auto_chunks"][0][0])
        return second_token_pvalue(target.model, prompt, sampling, counts)

    assert pvalue() > 1e-3
    assert {"head", "draft", "guess"} <= first  # the requests switch between the candidates
    broken_rule(monkeypatch)
    assert pvalue() < 1e-4


def test_auto_options_are_checked_in_one_line(engine):
    with pytest.raises(DraftVerifyError, match="unknown auto candidate 'heads'.*use=head\\+lookup"):
        engine.generate("hi", method="auto", use="heads+context")
    with pytest.raises(DraftVerifyError, match="probe=0 must be at least 1"):
        engine.generate("hi", method="auto", probe=0)
    with pytest.raises(DraftVerifyError, match="width=0 must lie in 1..64"):
        engine.generate("hi", method="auto", width=0)


def test_generate_explain_names_who_drafted(tiny, tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target = tiny("llama", layers=2)
    target.model.save_pretrained(tmp_path / "t")
    target.tokenizer.save_pretrained(tmp_path / "t")
    args = [
        "generate",
        "abc abc abc",
        "--target",
        str(tmp_path / "t"),
        "--draft",
        "self:layers=1",
        "-n",
        "12",
        "--no-chat",
        "--explain",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "prefill" in result.output and "tokens by drafter:" in result.output
    result = CliRunner().invoke(app, args + ["--method", "autoregressive"])
    assert result.exit_code != 0 and "--explain needs method auto" in str(result.exception)


def test_the_context_candidate_follows_the_lookahead_context_preset(tiny, monkeypatch):
    """auto's `context` candidate is `lookahead:context`: a change to that preset is a change to the candidate."""
    from draftverify.methods.auto import Auto
    from draftverify.methods.lookahead import Lookahead

    monkeypatch.setitem(Lookahead.presets, "context", {"W": 0, "N": 4, "G": 3, "context": True})
    auto = Auto(Runner(tiny("llama", layers=1).model), config=Auto.make_config(use="context"))
    context = auto.candidates(None)["context"]
    assert (context.W, context.N, context.G, context.context) == (0, 4, 3, True)
    assert (context.pool.n, context.pool.cap) == (4, 3)


def test_two_auto_instances_keep_their_own_figures(tiny):
    """What one method instance learnt (its `Figures`) never steers another's; batch slots share their first's."""
    from draftverify.methods.auto import Auto

    runner = Runner(tiny("llama", layers=1).model)
    first, second, slot = Auto(runner), Auto(runner), Auto(runner)
    slot.share(first)
    first.figures.scale = 3.0
    assert second.figures.scale == 1.0 and slot.figures is first.figures
