"""Structured output (`response_format`): the grammar masks the target's distribution at every verified
position. Greedy output validates and is token-identical under every method; sampled output follows the
masked target distribution (chi-square) and not an unconditioned one (the negative control)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from conftest import give_curve
from scipy.stats import chisquare

from draftverify import Engine
from draftverify.constraints import Format, Grammar, parse_response_format
from draftverify.drafters.feature import TREE_WIDTHS
from draftverify.errors import DraftVerifyError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
METHODS = [
    ("speculative", {"k": 3}),
    ("lookahead", {}),
    ("ouroboros", {}),
    ("prompt-lookup", {}),
    ("self-speculative", {"strategy": "heuristic"}),
    ("auto", {}),
]


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny("llama"), tiny("llama", seed=1, layers=2))


@pytest.mark.parametrize("prompt", ["Hi", "A person: "])
def test_json_schema_validates_and_every_method_agrees(engine, prompt):
    ar = engine.generate(prompt, method="autoregressive", max_new_tokens=100, response_format=FORMAT)
    plain = engine.generate(prompt, method="autoregressive", max_new_tokens=100)
    assert ar.tokens != plain.tokens, "the grammar changes nothing here: the test could not fail"
    assert ar.stats.finish_reason == "eos"
    jsonschema.validate(json.loads(ar.text), SCHEMA)
    for method, options in METHODS:
        out = engine.generate(prompt, method=method, max_new_tokens=100, response_format=FORMAT, **options)
        assert out.tokens == ar.tokens, method


def test_json_object_and_regex(engine):
    out = engine.generate("Hi", method="speculative", k=3, max_new_tokens=60, response_format="json_object")
    assert out.stats.finish_reason in ("eos", "length")
    if out.stats.finish_reason == "eos":
        assert isinstance(json.loads(out.text), dict)
    regex = {"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}
    out = engine.generate("Hi", method="lookahead", max_new_tokens=20, response_format=regex)
    assert len(out.text) == 6 and out.text[3] == "-" and out.text[:3].isdigit()


def test_sampled_json_validates(engine):
    for seed in range(4):
        out = engine.generate(
            "Hi", method="speculative", k=3, max_new_tokens=100, response_format=FORMAT, temperature=1.0, seed=seed
        )
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_invalid_formats_are_one_line_errors(engine):
    with pytest.raises(DraftVerifyError, match="json_schema is invalid"):
        engine.generate("Hi", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    with pytest.raises(DraftVerifyError, match="unknown"):
        parse_response_format({"type": "yaml"})
    with pytest.raises(DraftVerifyError, match="json_schema is missing"):
        parse_response_format({"type": "json_schema"})
    assert parse_response_format({"type": "text"}) is None


N = 2000
LETTERS = "abcde"
CHEAP_ROWS = {w: 0.02 + 0.001 * w for w in TREE_WIDTHS}  # made up: a fixed part and a small part per row


@pytest.mark.parametrize("method, sep", [("speculative", ""), ("auto", "-")])
def test_sampling_follows_masked_distribution(engine, method, sep):
    """Two letters from [a-e] (with `auto`, a '-' between them that the grammar forces and auto drafts): the pair's
    counts against the masked target's joint distribution. The negative control draws the second letter as the
    first (ignoring the verified prefix)."""
    tok = engine.target.tokenizer
    ids = engine.encode("xy")
    allowed = [tok.convert_tokens_to_ids(c) for c in LETTERS]
    between = [tok.convert_tokens_to_ids(sep)] if sep else []
    fmt = {"type": "regex", "regex": f"[{LETTERS}]{sep}[{LETTERS}]"}
    counts = np.zeros((5, 5))
    drafted = 0
    options = {"k": 3} if method == "speculative" else {}
    give_curve(engine, CHEAP_ROWS)  # rows cheap enough that auto drafts a single forced token
    try:
        for seed in range(N):
            out = engine.generate(
                ids,
                method=method,
                max_new_tokens=3 + len(between),
                temperature=1.0,
                seed=seed,
                response_format=fmt,
                **options,
            )
            assert out.tokens[1 : 1 + len(between)] == between
            counts[allowed.index(out.tokens[0]), allowed.index(out.tokens[1 + len(between)])] += 1
            drafted += out.stats.extra.get("auto_grammar_tokens", 0)
    finally:
        give_curve(engine, None)
    assert method != "auto" or drafted >= N, "auto did not draft the forced text: the test could not fail"
    with torch.no_grad():
        first = engine.target.model(torch.tensor([ids])).logits[0, -1, allowed].softmax(-1)  # [5]
        seqs = torch.tensor([ids + [a] + between for a in allowed])
        second = engine.target.model(seqs).logits[:, -1][:, allowed].softmax(-1)  # [5, 5]
    exact = (first[:, None] * second).flatten().double().numpy()
    control = (first[:, None] * first[None, :]).flatten().double().numpy()
    for dist, right in ((exact, True), (control, False)):
        pvalue = chisquare(counts.flatten(), dist / dist.sum() * N).pvalue
        assert (pvalue > 1e-3) if right else (pvalue < 1e-6), (right, pvalue)


def test_auto_drafts_the_text_the_grammar_forces(engine):
    """Under a JSON schema the grammar alone writes the keys, their quotes and colons: `auto` proposes that text
    (`drafters.grammar`), verification accepts it, and the reply takes fewer target forwards than tokens, with
    plain decoding's tokens. Without the grammar candidate (use=lookup) nothing drafts it: a forward a token."""
    tok = engine.target.tokenizer
    grammar = Grammar(Format("json_schema", SCHEMA), tok, engine.eos_ids())
    assert tok.decode(grammar.forced([])) == '{"name":"'
    ar = engine.generate("Hi", method="autoregressive", max_new_tokens=100, response_format=FORMAT)
    out = engine.generate("Hi", method="auto", max_new_tokens=100, response_format=FORMAT)
    assert out.tokens == ar.tokens
    extra = out.stats.extra
    assert extra["auto_grammar_tokens"] >= 2 * extra["auto_grammar_rounds"], extra
    assert out.stats.target_forwards < ar.stats.target_forwards
    without = engine.generate("Hi", method="auto", use="lookup", max_new_tokens=100, response_format=FORMAT)
    assert without.tokens == ar.tokens and "auto_grammar_rounds" not in without.stats.extra
    assert without.stats.target_forwards > out.stats.target_forwards
    plain = engine.generate("Hi", method="auto", max_new_tokens=20)
    assert "auto_grammar_rounds" not in plain.stats.extra  # no grammar: no candidate
