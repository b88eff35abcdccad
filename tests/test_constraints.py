"""Structured output (`response_format`): the grammar masks the target's distribution at every verified
position. Greedy output validates and is token-identical under every method; sampled output follows the
masked target distribution (chi-square) and not an unconditioned one (the negative control)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftverify import Engine
from draftverify.constraints import parse_response_format
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


def test_sampling_follows_masked_distribution(engine):
    """Two letters from [a-e]: the pair's counts against the masked target's joint distribution. The
    negative control draws the second letter as the first (ignoring the verified prefix)."""
    tok = engine.target.tokenizer
    ids = engine.encode("xy")
    allowed = [tok.convert_tokens_to_ids(c) for c in LETTERS]
    fmt = {"type": "regex", "regex": f"[{LETTERS}]{{2}}"}
    counts = np.zeros((5, 5))
    for seed in range(N):
        out = engine.generate(
            ids, method="speculative", k=3, max_new_tokens=3, temperature=1.0, seed=seed, response_format=fmt
        )
        counts[allowed.index(out.tokens[0]), allowed.index(out.tokens[1])] += 1
    with torch.no_grad():
        first = engine.target.model(torch.tensor([ids])).logits[0, -1, allowed].softmax(-1)  # [5]
        seqs = torch.tensor([ids + [a] for a in allowed])
        second = engine.target.model(seqs).logits[:, -1][:, allowed].softmax(-1)  # [5, 5]
    exact = (first[:, None] * second).flatten().double().numpy()
    control = (first[:, None] * first[None, :]).flatten().double().numpy()
    for dist, right in ((exact, True), (control, False)):
        pvalue = chisquare(counts.flatten(), dist / dist.sum() * N).pvalue
        assert (pvalue > 1e-3) if right else (pvalue < 1e-6), (right, pvalue)
