"""The phrase pool: LRU per first token, caps, newest-first retrieval, inspiration, refinement,
and its file (round trip, atomic writes, refusal of corrupt or mismatched files)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftverify import DraftVerifyError
from draftverify.drafters.pool import PhrasePool, inspirations

N, CAP = 3, 4
tokens = st.integers(0, 5)  # a small alphabet so that keys and phrases repeat
phrases = st.lists(tokens, min_size=N, max_size=N)


class Reference:
    """The pool's contract, written as plainly as possible: per key a list, oldest first."""

    def __init__(self, cap):
        self.cap, self.lists = cap, {}

    def insert(self, phrase):
        entries = self.lists.setdefault(phrase[0], [])
        rest = tuple(phrase[1:])
        if rest in entries:
            entries.remove(rest)
        entries.append(rest)
        del entries[: max(0, len(entries) - self.cap)]

    def replace(self, key, old, new):
        entries = self.lists.get(key, [])
        if old == new:
            return
        if old not in entries:
            self.insert((key,) + new)
        elif new in entries:
            entries.remove(old)
        else:
            entries[entries.index(old)] = new


@settings(max_examples=200, deadline=None)
@given(st.lists(phrases, max_size=60), st.integers(1, 6))
def test_lru_cap_and_newest_first(inserted, k):
    pool, ref = PhrasePool(N, CAP), Reference(CAP)
    for phrase in inserted:
        pool.insert(phrase)
        ref.insert(phrase)
    for key in range(6):
        expected = list(reversed(ref.lists.get(key, [])))
        assert pool.get(key) == expected  # newest first, LRU order, duplicates refreshed not repeated
        assert pool.get(key, k) == expected[:k]
        assert len(pool.get(key)) <= CAP
    assert len(pool) == sum(len(v) for v in ref.lists.values())
    if inserted:
        last = inserted[-1]
        assert pool.get(last[0], 1) == [tuple(last[1:])]  # the latest insert is the newest of its key
        assert last in pool


@settings(max_examples=200, deadline=None)
@given(st.lists(phrases, max_size=30), st.lists(st.tuples(tokens, phrases), max_size=10))
def test_refinement_replaces_in_place(inserted, refinements):
    pool, ref = PhrasePool(N, CAP), Reference(CAP)
    for phrase in inserted:
        pool.insert(phrase)
        ref.insert(phrase)
    for key, phrase in refinements:
        old = pool.get(key, 1)[0] if pool.get(key) else tuple(phrase[1:])  # mostly an entry that exists
        new = tuple(phrase[1:])
        pool.replace(key, old, new)
        ref.replace(key, old, new)
    for key in range(6):
        assert pool.get(key) == list(reversed(ref.lists.get(key, [])))
        assert len(set(pool.get(key))) == len(pool.get(key)) <= CAP


POOL = '{"format": "draftverify-phrase-pool", "version": 1, "tokenizer": "abc", "n": 3, "cap": 4, "phrases": '


def test_refinement_keeps_the_recency_slot():
    pool = PhrasePool(3, 3)
    for rest in ([1, 1], [2, 2], [3, 3]):
        pool.insert([7] + rest)
    assert pool.replace(7, (2, 2), (9, 9))
    assert pool.get(7) == [(3, 3), (9, 9), (1, 1)]
    assert pool.replace(7, (9, 9), (3, 3))  # already there: the old one just goes
    assert pool.get(7) == [(3, 3), (1, 1)]
    assert pool.replace(7, (5, 5), (6, 6))  # evicted meanwhile: the refined phrase is inserted as newest
    assert pool.get(7) == [(6, 6), (3, 3), (1, 1)]
    assert not pool.replace(7, (6, 6), (6, 6))


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=12), st.data())
def test_inspiration_takes_only_matches_after_the_correction(draft, data):
    predicted = data.draw(st.lists(tokens, min_size=len(draft) + 1, max_size=len(draft) + 1))
    accepted = data.draw(st.integers(0, len(draft) - 1))
    n = data.draw(st.integers(2, 5))
    found = inspirations(draft, predicted, accepted, n)
    starts = [i for i in range(accepted + 1, len(draft) - n + 2) if draft[i : i + n - 1] == predicted[i : i + n - 1]]
    assert found == [tuple(predicted[i : i + n]) for i in starts]
    for phrase in found:
        assert len(phrase) == n
    # a draft that agrees with the target everywhere after the correction yields every window there
    agreeing = predicted[: len(draft)]
    assert len(inspirations(agreeing, predicted, accepted, n)) == max(0, len(draft) - n + 1 - accepted)


def test_inspiration_hand_case():
    # Ouroboros v1, Figure 1: the draft went wrong at W, but KLMN matched the target's predictions.
    E, F, G, H, Ii, J, W, K, L, M, Nn, Oo = range(12)  # Ii, Nn, Oo: I, N, O
    draft = [E, F, G, H, Ii, W, K, L, M, Nn]
    predicted = [E, F, G, H, Ii, J, K, L, M, Nn, Oo]  # the target's token at each draft position, and after
    assert inspirations(draft, predicted, accepted=5, n=4) == [(K, L, M, Nn), (L, M, Nn, Oo)]
    assert inspirations(draft, predicted, accepted=5, n=6) == []  # no 5 matching tokens after the correction


def test_save_load_round_trip(tmp_path):
    pool = PhrasePool(3, 4)
    for phrase in ([1, 2, 3], [1, 4, 5], [2, 2, 2], [1, 2, 3], [9, 8, 7]):
        pool.insert(phrase)
    path = tmp_path / "sub" / "pool.json"
    pool.save(path, tokenizer="abc")
    back = PhrasePool.load(path, "abc", n=3, cap=4)
    assert {k: back.get(k) for k in back.keys()} == {k: pool.get(k) for k in pool.keys()}
    smaller = PhrasePool.load(path, "abc", n=3, cap=1)  # a smaller cap keeps the newest
    assert smaller.get(1) == [(2, 3)]
    assert [p.name for p in path.parent.iterdir()] == ["pool.json"]  # no temporary file left behind


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "pool.json"
    pool = PhrasePool(2, 2)
    pool.insert([1, 2])
    pool.save(path, tokenizer="t")
    before = path.read_text()
    pool.insert([3, 4])

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", explode)
    with pytest.raises(OSError):
        pool.save(path, tokenizer="t")
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["pool.json"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"format": "draftverify-phrase-pool", "version": 1, "tok', "unreadable or corrupt"),
        ("[1, 2, 3]", "not a draftverify phrase pool"),
        ('{"format": "draftverify-phrase-pool", "version": 7}', "version 7"),
        (
            POOL.replace('"abc"', '"other"') + "{}}",
            "another tokenizer",
        ),
        (
            '{"format": "draftverify-phrase-pool", "version": 1, "tokenizer": "abc", "n": 5, "cap": 4, "phrases": {}}',
            "N=5",
        ),
        (
            POOL + "[]}",
            "no phrase table",
        ),
        (
            POOL + '{"1": [[2]]}}',
            "bad phrase",
        ),
        (
            POOL + '{"1": [[2, -4]]}}',
            "bad phrase",
        ),
        (
            POOL + '{"1": [[2, 999]]}}',
            "bad phrase",
        ),
        (
            POOL + '{"x": [[2, 3]]}}',
            "bad entry",
        ),
    ],
)
def test_bad_files_are_refused(tmp_path, content, message):
    path = tmp_path / "pool.json"
    path.write_text(content)
    with pytest.raises(DraftVerifyError, match=message) as err:
        PhrasePool.load(path, "abc", n=3, cap=4, vocab_size=100)
    assert "\n" not in str(err.value)


def test_invalid_settings():
    with pytest.raises(DraftVerifyError, match="N=1"):
        PhrasePool(1, 4)
    with pytest.raises(DraftVerifyError, match="G=0"):
        PhrasePool(3, 0)
    with pytest.raises(DraftVerifyError, match="3 tokens"):
        PhrasePool(3, 2).insert([1, 2])
