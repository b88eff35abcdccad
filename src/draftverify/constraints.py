"""Structured output: a grammar (JSON schema, any JSON object, a regex or a Lark grammar) as the set of
tokens allowed after a prefix, through llguidance.

llguidance was chosen over xgrammar and outlines-core because it computes a token mask on the fly
from the prefix (no per-schema precompilation of the vocabulary), its masks are computed on the CPU
in Rust, and its matcher rolls back consumed tokens (`rollback(n)`), which is exactly what verifying
a tree of drafts needs: walk into each node's path, read the mask, roll back. The matcher follows the
request's emitted tokens only, so a rejected draft never moves it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import numpy as np
import torch

from draftverify.errors import DraftVerifyError, require

KINDS = ("json_object", "json_schema", "regex", "lark")
# Compact JSON (no whitespace between tokens): a model cannot spend its tokens on endless indentation.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Format:
    """What the output must match: `kind` one of KINDS; `spec` the schema (a dict), regex or Lark text."""

    kind: str
    spec: object = None

    def __post_init__(self):
        require(self.kind in KINDS, f"response format {self.kind!r} is unknown: use one of {', '.join(KINDS)}")

    def grammar_text(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            require(isinstance(self.spec, dict), "json_schema's schema must be a JSON object: give a schema dict")
            return LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_OPTIONS)
        require(isinstance(self.spec, str) and self.spec, f"the {self.kind} is empty: give its text")
        return (
            LLMatcher.grammar_from_regex(self.spec) if self.kind == "regex" else LLMatcher.grammar_from_lark(self.spec)
        )


def parse_response_format(value: dict | str | None) -> Format | None:
    """An OpenAI `response_format` (plus the extensions {"type": "regex", "regex": ...} and {"type": "lark",
    "lark": ...}) -> Format, None for text. A JSON-schema file's text or dict is also accepted."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"type": value}
    require(isinstance(value, dict) and "type" in value, "response_format must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_schema":
        inner = value.get("json_schema")
        require(isinstance(inner, dict), "response_format.json_schema is missing: give {'name': ..., 'schema': {...}}")
        return Format("json_schema", inner.get("schema", {}))
    if kind in ("regex", "lark"):
        return Format(kind, value.get(kind))
    return Format(kind)


_TOKENIZERS: dict[tuple, tuple] = {}  # (id(tokenizer), eos) -> (tokenizer, llguidance's view)


def ll_tokenizer(tokenizer, eos: tuple[int, ...]):
    """llguidance's view of a fast tokenizer (built once per tokenizer: it takes a while), from its Rust tokenizer's
    JSON, as llguidance's `from_tokenizer` reads a transformers one, but without importing transformers (a
    `FastTokenizer` has the same Rust tokenizer)."""
    key = (id(tokenizer), tuple(eos))
    if key not in _TOKENIZERS:
        require(getattr(tokenizer, "is_fast", False), "structured output needs a fast tokenizer (tokenizer.json)")
        try:
            view = _from_backend(tokenizer, eos)
        except ValueError:  # a decoder llguidance does not read (e.g. Fuse): give it each token's bytes instead
            view = _by_bytes(tokenizer, eos)
        _TOKENIZERS[key] = (tokenizer, view)  # the tokenizer held too: its id is never another's while kept here
    return _TOKENIZERS[key][1]


def warm(tokenizer, eos: tuple[int, ...]) -> None:
    """Build llguidance's view of `tokenizer` now (a server at start), so no request waits for it."""
    if getattr(tokenizer, "is_fast", False):
        ll_tokenizer(tokenizer, eos)


def _from_backend(tokenizer, eos: tuple[int, ...]):
    from llguidance import LLTokenizer

    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), eos_token=list(eos) or tokenizer.eos_token_id)


def _by_bytes(tokenizer, eos: tuple[int, ...]):
    """llguidance's tokenizer from each token's own decoded bytes (special tokens: none)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    special = set(tokenizer.all_special_ids)
    n = len(tokenizer)

    class Tokens:
        eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        bos_token_id = tokenizer.bos_token_id
        tokens = [b"" if i in special else tokenizer.decode([i]).encode() for i in range(n)]
        special_token_ids = sorted(special)

        def __call__(self, text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

    return LLTokenizer(TokenizerWrapper(Tokens()), eos_token=list(eos) or None)


class Grammar:
    """One request's grammar matcher, kept at the request's output; `allowed` reads the mask after any prefix."""

    def __init__(self, fmt: Format, tokenizer, eos: tuple[int, ...]):
        from llguidance import LLMatcher

        text = fmt.grammar_text()
        lltok = ll_tokenizer(tokenizer, eos)
        error = LLMatcher.validate_grammar(text, lltok)
        if error and not error.startswith("WARNING"):
            raise DraftVerifyError(f"the {fmt.kind} is invalid: {error.splitlines()[0]}")
        self.matcher = LLMatcher(lltok, text, log_level=0)
        self.tokens = lltok
        self.known = lltok.vocab_size  # ids at or above it (a model's padded vocabulary) are never allowed
        require(not self.matcher.is_error(), f"the {fmt.kind} is invalid: {self.matcher.get_error()}")
        self.consumed = 0  # how many output tokens the matcher has taken

    def follow(self, output: list[int]) -> None:
        """Move the matcher to the end of `output`."""
        new = output[self.consumed :]
        if new:
            self.matcher.consume_tokens(new)
            self.consumed = len(output)

    def forced(self, output: list[int]) -> list[int]:
        """The text the grammar allows next and nothing else (a JSON schema's next key and its quotes), as the
        tokenizer would write it alone, after `output`; [] where the grammar leaves the next byte open. The model may
        write the same text in other tokens (the mask allows any that spell it): these are a guess to verify."""
        self.follow(output)
        if self.matcher.is_stopped() or self.matcher.is_error():
            return []
        text = self.matcher.compute_ff_bytes()
        return self.tokens.tokenize_bytes(text) if text else []

    def allowed(self, output: list[int], paths: list[list[int]], vocab: int) -> torch.Tensor:
        """[len(paths), vocab] bool: the tokens the grammar allows after output + paths[i]. A path the grammar
        rejects gets every token (its node cannot be accepted, so its row is never read)."""
        self.follow(output)
        rows = np.ones((len(paths), vocab), dtype=bool)
        for i, path in enumerate(paths):
            known = next((j for j, t in enumerate(path) if t >= self.known), len(path))  # an unknown id ends it
            taken = self.matcher.try_consume_tokens(path[:known]) if known else 0
            if taken == len(path):
                rows[i] = self._mask(vocab)
            if taken:
                self.matcher.rollback(taken)
        return torch.from_numpy(rows)

    def _mask(self, vocab: int) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.shape[0])
        mask[:n] = bits[:n].astype(bool)
        return mask


def load_schema_file(path: str) -> dict:
    """A JSON-schema file -> the schema dict, or a one-line error."""
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as err:
        raise DraftVerifyError(f"cannot read the JSON schema {path}: {err}") from None
    require(isinstance(schema, dict), f"{path} holds no JSON object: a schema is an object")
    return schema
