"""The incremental detokenizer: its text is the whole list's decode after every step, and a step's cost does not
grow with the list."""

from __future__ import annotations

import random

import pytest

from draftverify.detokenize import CONTEXT, Detokenizer
from draftverify.serve.protocol import TextStream
from draftverify.session import Session, Stopping


def llama2_style_tokenizer():
    """A SentencePiece-style tokenizer as Llama 2's: "▁" for spaces, byte fallback <0xNN> pieces (a character split
    over several tokens), the first space stripped, and special tokens that decode to nothing."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    pieces += ["▁", "▁the", "▁a", "a", "b", "é", "▁東", "京", ".", "▁.", "x", "**", "▁🚀"]
    tok = Tokenizer(
        models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True)
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return fast, len(pieces)


class Counting:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def assert_exact_at_every_step(tokenizer, ids: list[int], seed: int) -> None:
    rng, decoded, i = random.Random(seed), Detokenizer(tokenizer), 0
    while i < len(ids):
        n = rng.choice([0, 1, 1, 1, 2, 3, 5])
        text = decoded.extend(ids[i : i + n])
        i += n
        assert text == decoded.text == tokenizer.decode(ids[:i], skip_special_tokens=True), (seed, i)


def test_the_text_is_the_whole_decode_after_every_step_with_byte_fallback_and_special_tokens():
    tok, vocab = llama2_style_tokenizer()
    rng = random.Random(0)
    for seed in range(30):
        # mostly text pieces, with raw bytes (split and broken characters) and special tokens among them
        ids = [rng.randrange(259, vocab) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(120)]
        assert_exact_at_every_step(tok, ids, seed)
    emoji = tok("▁a 🚀 é 東京 x**")["input_ids"]
    assert_exact_at_every_step(tok, emoji * 3, 0)


def test_the_text_is_exact_where_a_decoder_rewrites_text_across_tokens():
    """A clean-up of the joined text as transformers' `clean_up_tokenization` (" ," -> ",") rewrites what a token
    before gave: "a " and then "a ," -> "a,". A window then no longer extends its context, and the whole list is
    decoded instead."""

    class CleanUp:
        pieces = ["a", "b", " ", ",", "."]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.pieces[i] for i in ids).replace(" ,", ",")

    tok, rng = CleanUp(), random.Random(1)
    ids = [rng.randrange(len(CleanUp.pieces)) for _ in range(300)]
    assert tok.decode([0, 2, 3]) == "a," and tok.decode([0, 2]) == "a "  # the rewrite at work
    for seed in range(10):
        assert_exact_at_every_step(tok, ids, seed)


def test_a_step_costs_the_same_at_the_end_of_a_long_reply(tokenizer):
    ids = tokenizer("the quick brown fox jumps over the lazy dog. " * 60)["input_ids"]
    counting = Counting(tokenizer)
    decoded = Detokenizer(counting)
    for t in ids:
        decoded.extend([t])
    assert decoded.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded <= 4 * (CONTEXT + 1) * len(ids)  # whole-list decodes would be len(ids)^2 / 2


def test_stop_strings_and_streamed_text_decode_a_window_a_token(tokenizer):
    text = "the quick brown fox jumps over the lazy dog. " * 40 + "STOP here"
    ids = tokenizer(text)["input_ids"]
    counting = Counting(tokenizer)
    session = Session(ids[:1], None, Stopping(max_new_tokens=10_000, stop_strings=("STOP",)), tokenizer=counting)
    stream = TextStream(counting, ["STOP"])
    sent = ""
    for t in ids:
        if not session.emit([t]):
            break
        sent += stream.push([t])
    assert session.stats.finish_reason == "stop"
    assert session.text() == text[: text.index("STOP")]
    assert sent + stream.finish(session.text()) == session.text()
    assert counting.decoded <= 2 * 4 * (CONTEXT + 1) * len(ids) + 2 * len(ids)  # and the one whole decode of text()


@pytest.mark.slow
def test_the_text_is_the_whole_decode_on_the_real_tokenizer(smollm):
    tok = smollm.tokenizer
    rng = random.Random(2)
    ids = tok("Héllo wörld — 東京 🚀🎉 naïve café\n\tdef f(x): return x**2  # ok ✓")["input_ids"]
    assert_exact_at_every_step(tok, ids * 4, 0)
    for seed in range(10):  # any ids: byte-level pieces of broken characters, special tokens
        assert_exact_at_every_step(tok, [rng.randrange(len(tok)) for _ in range(300)], seed)
