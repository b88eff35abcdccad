"""Ouroboros: greedy output equals autoregressive decoding (tiny models of every architecture,
a random draft and the target as its own draft, every component on and off), the draft-length
policy hook, the pool's life across requests and files, exact sampling, and the real model."""

from __future__ import annotations

import phrase_sampling as ps
import pytest
from conftest import ARCHS, make_model

from draftverify import DraftVerifyError, Engine
from draftverify.drafters.pool import PhrasePool
from draftverify.loading import Loaded
from draftverify.methods.ouroboros import Ouroboros
from draftverify.policies import ConstantK, WholePhrases

PROMPTS = ["Hello there, how", "1, 2, 3, 4,"]
ABLATION = [  # the v2 paper's ablation order, then the papers' settings and other policies
    {"phrase_drafting": False, "lengthening": False, "inspiration": False, "refinement": False, "reuse": False},
    {"lengthening": False, "inspiration": False, "refinement": False, "reuse": False},
    {"inspiration": False, "refinement": False, "reuse": False},
    {"reuse": False},
    {},
    {"W": 0},
    {"gamma": 6, "W": 15, "N": 5, "G": 15, "K": 3},
    {"policy": "constant", "gamma": 3},
    {"policy": "confidence", "gamma": 8, "threshold": 0.3},
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_kind", ["random", "self"])
def test_greedy_equals_autoregressive(tiny, arch, draft_kind):
    target = tiny(arch, seed=0)
    engine = Engine(target, tiny(arch, seed=1, layers=2) if draft_kind == "random" else target)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[])
        for options in ABLATION:
            out = engine.generate(ids, method="ouroboros", max_new_tokens=40, eos_token_id=[], **options)
            assert out.tokens == ar.tokens, (arch, draft_kind, prompt, options)
            s, extra = out.stats, out.stats.extra
            assert s.target_forwards == len(s.steps) + 1 and sum(s.steps) == 39
            assert extra["draft_accepted"] + extra["suffix_accepted"] == s.accepted <= s.drafted
            if draft_kind == "self":  # the target drafting for itself: every drafted token is accepted
                assert extra["draft_accepted"] == extra["draft_tokens"] > 0


def test_components_switch_off(tiny):
    engine = Engine(tiny("gpt2", seed=0), tiny("gpt2", seed=1, layers=2))
    ids = engine.encode("1, 2, 3, 4,")
    off = engine.generate(ids, method="ouroboros", max_new_tokens=40, eos_token_id=[], **ABLATION[0]).stats
    assert off.extra.get("window_ngrams", 0) == off.extra.get("phrase_tokens", 0) == 0
    assert off.extra.get("inspired", 0) == off.extra.get("refined", 0) == off.extra["suffix_accepted"] == 0
    assert off.extra["pool_phrases"] == 0 and off.draft_forwards == off.extra["draft_tokens"]  # one token per forward
    on = engine.generate(ids, method="ouroboros", max_new_tokens=40, eos_token_id=[], reuse=False).stats
    assert on.extra["window_ngrams"] > 0 and on.extra["refined"] > 0 and on.extra["pool_phrases"] > 0
    assert on.draft_forwards < on.extra["draft_tokens"]  # phrases: several draft tokens per draft forward


class Recorder(WholePhrases):
    """The default policy, recording what the method asks and tells it."""

    def __init__(self, k):
        super().__init__(k)
        self.asked, self.told = [], []

    def keep_drafting(self, n, logits, hidden):
        self.asked.append(n)
        return super().keep_drafting(n, logits, hidden)

    def observe(self, drafted, accepted):
        self.told.append((drafted, accepted))


def test_policy_hook_whole_phrases_then_cut(tiny, monkeypatch):
    engine = Engine(tiny("llama", seed=0), tiny("llama", seed=1, layers=2))
    ids = engine.encode("1, 2, 3, 4,")
    recorders = []
    monkeypatch.setattr(
        Ouroboros, "make_policy", lambda self: recorders.append(Recorder(self.config.gamma)) or recorders[-1]
    )
    engine.generate(ids, method="ouroboros", max_new_tokens=60, eos_token_id=[], gamma=3, W=3, N=4, G=3, K=0)
    told = recorders[0].told
    assert told and all(drafted >= 3 for drafted, _ in told[:-3])  # whole phrases until >= gamma (the end may cut)
    assert any(drafted > 3 for drafted, _ in told)  # ... so a phrase can overshoot gamma
    assert recorders[0].asked  # asked after every drafted token: a head policy can cut inside a phrase

    cut = []
    monkeypatch.setattr(Ouroboros, "make_policy", lambda self: cut.append(ConstantK(2)) or cut[-1])
    out = engine.generate(ids, method="ouroboros", max_new_tokens=60, eos_token_id=[], gamma=3, W=3, N=4, G=3, K=0)
    assert out.stats.extra["draft_tokens"] <= 2 * out.stats.target_forwards  # cut inside phrases at 2


def test_pool_lives_across_requests_and_files(tiny, tmp_path):
    target = tiny("llama", seed=0)
    engine = Engine(target, tiny("llama", seed=1, layers=2))
    ids = engine.encode("1, 2, 3, 4,")
    path = tmp_path / "pool.json"
    first = engine.generate(ids, method="ouroboros", max_new_tokens=30, eos_token_id=[], pool_file=str(path))
    method = engine.method("ouroboros", pool_file=str(path))
    saved = PhrasePool.load(path, method._fingerprint, 3, 2)
    assert len(saved) == first.stats.extra["pool_phrases"] > 0
    assert {k: method.pool.get(k) for k in method.pool.keys()} == {
        k: saved.get(k) for k in saved.keys()
    }  # the next request starts warm
    second = engine.generate(ids, method="ouroboros", max_new_tokens=30, eos_token_id=[], pool_file=str(path))
    assert second.tokens == first.tokens
    # a new engine (another process) starts from the file
    again = Engine(target, tiny("llama", seed=1, layers=2))
    again.generate(ids, method="ouroboros", max_new_tokens=1, eos_token_id=[], pool_file=str(path))
    pool = again.method("ouroboros", pool_file=str(path)).pool
    assert {k: pool.get(k) for k in pool.keys()} == {k: method.pool.get(k) for k in method.pool.keys()}
    # reuse=False: every request starts fresh, and the file is left alone
    before = path.read_bytes()
    fresh = [
        engine.generate(ids, method="ouroboros", max_new_tokens=30, eos_token_id=[], reuse=False).stats
        for _ in range(2)
    ]
    assert fresh[0].extra == fresh[1].extra
    engine.generate(ids, method="ouroboros", max_new_tokens=30, eos_token_id=[], reuse=False, pool_file=str(path))
    assert path.read_bytes() == before


def test_pool_file_is_checked(tiny, tmp_path):
    target = tiny("llama", seed=0)
    engine = Engine(target, tiny("llama", seed=1, layers=2))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "draftverify-phrase-pool", "vers')
    with pytest.raises(DraftVerifyError, match="corrupt"):
        engine.generate("Hi", method="ouroboros", max_new_tokens=5, pool_file=str(corrupt))
    foreign = tmp_path / "foreign.json"
    PhrasePool(3, 2).save(foreign, tokenizer="another-tokenizer")
    with pytest.raises(DraftVerifyError, match="another tokenizer"):
        engine.generate("Hi", method="ouroboros", max_new_tokens=5, pool_file=str(foreign))
    with pytest.raises(DraftVerifyError, match="N=3 tokens but the method uses N=4"):
        engine.generate("Hi", method="ouroboros", max_new_tokens=5, N=4, pool_file=str(engine_pool(engine, tmp_path)))


def engine_pool(engine, tmp_path):
    path = tmp_path / "made-here.json"
    engine.generate("Hi", method="ouroboros", max_new_tokens=5, pool_file=str(path))
    return path


def test_bad_settings(tiny):
    engine = Engine(tiny("llama"), tiny("llama", seed=1, layers=2))
    for options, message in [
        ({"K": 5, "G": 2}, "K=5"),
        ({"gamma": 0}, "gamma=0"),
        ({"policy": "nope"}, "unknown draft policy"),
    ]:
        with pytest.raises(DraftVerifyError, match=message):
            engine.generate("Hi", method="ouroboros", **options)
    with pytest.raises(DraftVerifyError, match="needs a draft"):
        Engine(tiny("llama")).generate("Hi", method="ouroboros")


OPTIONS = dict(gamma=1, W=2, N=3, G=3, K=3)  # drafts of a phrase or two, then suffixes: both kinds of node


def sampling_engine(tokenizer):
    target = Loaded(make_model("llama", 0, layers=2, hidden=32, vocab=ps.VOCAB), tokenizer, "tiny8")
    return Engine(target, Loaded(make_model("llama", 3, layers=1, hidden=32, vocab=ps.VOCAB), tokenizer, "draft8"))


def test_sampling_matches_target(tokenizer):
    engine = sampling_engine(tokenizer)
    counts = ps.sample_first_three(engine, "ouroboros", ps.guess_pool(3, 3), **OPTIONS)
    assert ps.pvalue(counts, ps.exact_first_three(engine.target.model)) > 1e-3


def test_sampling_test_catches_a_wrong_rule(tokenizer, monkeypatch):
    ps.broken_rule(monkeypatch)
    engine = sampling_engine(tokenizer)
    counts = ps.sample_first_three(engine, "ouroboros", ps.guess_pool(3, 3), **OPTIONS)
    assert ps.pvalue(counts, ps.exact_first_three(engine.target.model)) < 1e-6


@pytest.mark.slow
def test_default_target_greedy(smollm):
    """The real default target with its default draft: lookahead and Ouroboros equal greedy decoding."""
    from draftverify.loading import load_draft

    engine = Engine(smollm, load_draft(None, smollm))
    for prompt in ["Write a Python function that reverses a string.", "What is 17 times 23? Think step by step."]:
        ids = engine.encode(prompt, chat=True)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=32)
        for method, options in [
            ("lookahead", {}),
            ("ouroboros", {}),
            ("ouroboros", {"gamma": 6, "W": 15, "N": 5, "G": 15, "K": 3}),
        ]:
            assert engine.generate(ids, method=method, max_new_tokens=32, **options).tokens == ar.tokens, (
                prompt,
                method,
                options,
            )


def test_lengthening_over_the_head_verifies_suffixes_only_while_they_pay():
    """With a cost curve (Ouroboros over the feature head) each round's suffixes are scored once the emitted tokens
    settle them, verified or not: the tokens they would have added where the whole draft was accepted, else none;
    they ride along only while that running mean, times a step, beats the rows they add."""
    from types import SimpleNamespace

    from draftverify.costs import Table
    from draftverify.drafters.base import Drafter, Proposal
    from draftverify.drafters.lengthened import Lengthened

    class Chain(Drafter):
        def propose(self, s, seq, room):
            return Proposal([[5, 6]])

    pool = PhrasePool(3, 2)
    pool.insert_all([(6, 7, 8), (6, 9, 9)])
    grow = Lengthened(Chain(), pool, K=2, costs=Table({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}))  # a row: 0.1 of a step
    s, seq = SimpleNamespace(others=0), list(range(10))
    assert len(grow.propose(s, seq, 8).paths) == 2 and grow.offered  # optimistic at first: the suffixes are verified
    grow.score(seq + [5, 6, 7])
    assert grow.offered and grow.gain == 1.0  # not settled: the suffix (7, 8) still follows what is known
    grow.score(seq + [5, 6, 7, 8])
    assert not grow.offered and grow.gain == pytest.approx(0.7 * 1.0 + 0.3 * 2)
    for _ in range(4):  # drafts cut short: no suffix could have followed
        grow.offered = [(10, [5, 6], [[7, 8]])]
        grow.score(seq + [5, 1])
    assert grow.gain < 0.4  # below the four rows' price, 0.4 of a step
    assert grow.propose(s, seq, 8).paths == [[5, 6]] and len(grow.offered) == 1  # not verified, but still scored


def test_the_roots_phrases_ride_beside_the_heads_draft_while_they_pay():
    """Phrase drafting over the head: the root's newest phrases are branches of their own beside the draft (none that
    the draft's tokens already hold), scored once the emitted tokens settle them by what the best of them adds beyond
    the rest of the proposal, and verified only while that running mean, times a step, beats their rows."""
    from types import SimpleNamespace

    from draftverify.costs import Table
    from draftverify.drafters.base import Drafter, Proposal
    from draftverify.drafters.lengthened import Lengthened

    class Chain(Drafter):
        def propose(self, s, seq, room):
            return Proposal([[5, 6]])

    pool = PhrasePool(3, 2)
    pool.insert_all([(9, 5, 6), (9, 7, 8)])  # the root is 9: (5, 6) is the draft's own, (7, 8) a branch of its own
    grow = Lengthened(Chain(), pool, K=0, costs=Table({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}), from_root=2)
    s, seq = SimpleNamespace(others=0), [1, 2, 9]
    assert grow.propose(s, seq, 8).paths == [[5, 6], [7, 8]]  # optimistic at first: tried
    grow.score_roots(seq + [7])
    assert grow.root_offered and grow.root_gain == 1.0  # not settled yet
    grow.score_roots(seq + [7, 8, 4])
    assert not grow.root_offered and grow.root_gain == pytest.approx(0.7 + 0.3 * 2)  # 2 tokens the draft lacked
    for _ in range(6):  # the draft's own tokens came: the phrase added nothing
        grow.root_offered = [(3, [[5, 6]], [[7, 8]])]
        grow.score_roots(seq + [5, 6, 1])
    assert grow.root_gain < 0.2  # below its two rows' price, 0.2 of a step
    assert grow.propose(s, seq, 8).paths == [[5, 6]] and len(grow.root_offered) == 1  # not verified, still scored
    assert Lengthened(Chain(), pool, K=0).propose(s, seq, 8).paths == [[5, 6]]  # off unless asked


def test_phrase_length_and_suffixes_follow_the_draft_unless_set():
    head, model = object(), object()
    over_head = Ouroboros(None, draft=head, feature_head=head)
    over_model = Ouroboros(None, draft=model, feature_head=head)
    assert (over_head.config.N, over_head.config.K) == (4, 1)
    assert (over_model.config.N, over_model.config.K) == (3, 2)
    asked = Ouroboros(None, draft=head, config=Ouroboros.Config(N=5, K=2), feature_head=head)
    assert (asked.config.N, asked.config.K) == (5, 2)
    with pytest.raises(DraftVerifyError, match="suffixes K=3"):
        Ouroboros.Config(K=3)
