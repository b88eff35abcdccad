"""Tokenizer checks: a draft must share the target's vocabulary exactly."""

from __future__ import annotations

import hashlib

from draftverify.errors import require


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(repr(vocab).encode()).hexdigest()[:16]


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    require(
        tokenizer_fingerprint(target_tokenizer) == tokenizer_fingerprint(draft_tokenizer),
        "draft and target tokenizers differ: pick a draft trained with the target's tokenizer "
        "(or build one with `draftverify make-draft`)",
    )
