"""Tokenizer checks: a draft must share the target's vocabulary exactly."""

from __future__ import annotations

import hashlib

from draftverify.errors import require

FINGERPRINT = "draftverify_fingerprint"  # the attribute holding (vocabulary size, fingerprint) once formed


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (token -> id). Kept on the tokenizer with its vocabulary's size and formed
    again when the size changes (added tokens); a GGUF target's comes from its metadata cache (`loading.gguf`)."""
    size = len(tokenizer)
    found = getattr(tokenizer, FINGERPRINT, None)
    if found is None or found[0] != size:
        vocab = sorted(tokenizer.get_vocab().items())
        found = (size, hashlib.sha1(repr(vocab).encode()).hexdigest()[:16])
        setattr(tokenizer, FINGERPRINT, found)
    return found[1]


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    require(
        tokenizer_fingerprint(target_tokenizer) == tokenizer_fingerprint(draft_tokenizer),
        "draft and target tokenizers differ: pick a draft trained with the target's tokenizer "
        "(or build one with `draftverify make-draft`)",
    )
