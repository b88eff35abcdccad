"""Lookahead decoding: greedy output equals autoregressive decoding on tiny models of every
architecture; the Jacobi window moves and harvests as specified; sampling is exact."""

from __future__ import annotations

import phrase_sampling as ps
import pytest
from conftest import ARCHS, make_model

from draftverify import DraftVerifyError, Engine
from draftverify.drafters.lookahead import JacobiWindow, ngrams
from draftverify.drafters.pool import PhrasePool
from draftverify.loading import Loaded

PROMPTS = ["Hello there, how", "def f(x):\n    return", "1, 2, 3, 4,"]
CONFIGS = [
    {},
    {"W": 1, "N": 2, "G": 1},
    {"W": 4, "N": 4, "G": 2},
    {"W": 15, "N": 5, "G": 15},
    {"preset": "context"},
    {"preset": "cpu-context"},
]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_autoregressive(tiny, arch):
    engine = Engine(tiny(arch, seed=0))
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[])
        for options in CONFIGS:
            la = engine.generate(ids, method="lookahead", max_new_tokens=40, eos_token_id=[], **options)
            assert la.tokens == ar.tokens, (arch, prompt, options)
            s = la.stats
            assert s.new_tokens == 40 and s.target_forwards == len(s.steps) + 1 and s.accepted <= s.drafted
            assert sum(s.steps) == 39  # every token after the first came out of a verification step


def test_an_oracle_pool_gives_whole_ngrams_plus_the_bonus(tiny):
    """With the true continuation in the pool, every step accepts N - 1 guessed tokens and adds the bonus."""
    engine = Engine(tiny("gpt2", seed=0))
    ids = engine.encode("Hello there, how")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[]).tokens
    method = engine.method("lookahead", W=1, N=4, G=64, reuse=True)
    method.pool = PhrasePool(4, 64)
    method.pool.insert_all(ar[i : i + 4] for i in range(len(ar) - 3))
    la = engine.generate(ids, method="lookahead", max_new_tokens=40, eos_token_id=[], W=1, N=4, G=64, reuse=True)
    assert la.tokens == ar
    assert la.stats.steps == [4] * 9 + [3]  # 39 tokens after the first; the last step has room for 2 guesses


def test_eos_inside_an_accepted_chunk(tiny):
    engine = Engine(tiny("llama", seed=0))
    ids = engine.encode("Hello there, how")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[])
    eos = ar.tokens[25]
    stop = ar.tokens.index(eos)
    la = engine.generate(ids, method="lookahead", max_new_tokens=40, eos_token_id=eos, W=4, N=4, G=4)
    assert la.tokens == ar.tokens[: stop + 1] and la.stats.finish_reason == "eos"


def test_window_moves_and_harvests():
    window = JacobiWindow(W=3, N=3, source=[50, 51, 52, 53, 54])
    assert window.rows == [[50, 51, 52]]
    assert window.for_root(9) == [[9, 51, 52]]
    assert window.advance(9, [60, 61, 62]) == []  # filling: rows shift one column, outputs give row 1
    assert window.rows == [[51, 52, 53], [61, 62, 54]]
    assert window.advance(8, [70, 71, 72]) == [(8, 61, 70), (52, 62, 71), (53, 54, 72)]  # column = one N-gram
    assert window.rows == [[61, 62, 54], [70, 71, 72]]
    assert window.for_root(7) == [[7, 62, 54], [70, 71, 72]]


def test_window_replaces_eos_guesses():
    window = JacobiWindow(W=2, N=2, source=[0, 5, 6], avoid=[0])  # EOS (0) is never used as filler
    assert window.rows == [[5, 6]]
    assert window.advance(9, [0, 3]) == [(9, 0), (6, 3)]  # an n-gram may end the text ...
    assert window.rows == [[5, 3]]  # ... but the window does not keep EOS guesses: they stall it


def test_bad_settings(tiny):
    engine = Engine(tiny("llama"))
    with pytest.raises(DraftVerifyError, match="N=1"):
        engine.generate("Hi", method="lookahead", N=1)
    with pytest.raises(DraftVerifyError, match="W=65"):
        engine.generate("Hi", method="lookahead", W=65)


def test_sampling_matches_target(tokenizer):
    target = Loaded(make_model("llama", 0, layers=2, hidden=32, vocab=ps.VOCAB), tokenizer, "tiny8")
    counts = ps.sample_first_three(Engine(target), "lookahead", ps.guess_pool(3, 3), W=2, N=3, G=3, reuse=True)
    assert ps.pvalue(counts, ps.exact_first_three(target.model)) > 1e-3


def test_sampling_test_catches_a_wrong_rule(tokenizer, monkeypatch):
    ps.broken_rule(monkeypatch)
    target = Loaded(make_model("llama", 0, layers=2, hidden=32, vocab=ps.VOCAB), tokenizer, "tiny8")
    counts = ps.sample_first_three(Engine(target), "lookahead", ps.guess_pool(3, 3), W=2, N=3, G=3, reuse=True)
    assert ps.pvalue(counts, ps.exact_first_three(target.model)) < 1e-6


def test_context_ngrams_guess_text_that_repeats_itself(tiny):
    """With `context`, the request's own n-grams are guesses: once a tiny model falls into a loop, whole
    n-grams are accepted without any window; without it (W = 0) nothing is ever guessed."""
    assert ngrams([1, 2, 3, 4], 3) == [(1, 2, 3), (2, 3, 4)]
    engine = Engine(tiny("llama", seed=0))
    ids = engine.encode("1, 2, 3, 4,")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=60, eos_token_id=[])
    ctx = engine.generate(ids, method="lookahead", preset="context", max_new_tokens=60, eos_token_id=[])
    bare = engine.generate(ids, method="lookahead", W=0, max_new_tokens=60, eos_token_id=[])
    assert ctx.tokens == bare.tokens == ar.tokens
    assert bare.stats.drafted == 0 and ctx.stats.extra["context_ngrams"] > len(ids)
    assert ctx.stats.accepted > 0 and ctx.stats.target_forwards < ar.stats.target_forwards
