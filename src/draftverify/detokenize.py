"""The decoded text of a growing token list, at a cost per new token that does not grow with the list.

Stop strings (`Session`) and streamed text (`serve.protocol.TextStream`) need the text of a reply after every token.
Decoding the whole reply each time costs time in proportion to its length, so a reply of n tokens costs n^2: for
this project's default tokenizer a 4096-token reply spends seconds re-decoding, on the decoding thread and on the
server's event loop. `Detokenizer` decodes only the new tokens behind a few before them, as text-generation servers
do, and checks each window against what it already holds.
"""

from __future__ import annotations

CONTEXT = 4  # tokens decoded in front of the new ones: a token's text may depend on those before it
INCOMPLETE = "\ufffd"  # what a decode gives for the bytes of a character that is not complete yet


class Detokenizer:
    """`text` is `tokenizer.decode(tokens, skip_special_tokens=True)` of every token given so far.

    A window of the last tokens is decoded with every new token: `settled` holds the text of the tokens before the
    new ones, `context` the text of the window's tokens among those. The window's text is taken where it extends
    `context` and, once it no longer ends in an incomplete character, joins `settled`: decoding is then local
    (byte-level BPE, SentencePiece, WordPiece: a token's text depends on a few neighbours at most), and `text` is what
    the whole list decodes to. Where a window does not extend its context (a decoder that rewrites text across
    tokens), the whole list is decoded instead and the window starts again after it, so `text` stays exact.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.settled = ""  # the text of tokens[: self.read], ending on a whole character
        self.start = 0  # the window's first token
        self.read = 0  # the tokens whose text is settled
        self.context = ""  # the text of tokens[self.start : self.read] decoded alone
        self.pending = ""  # the text of tokens[self.read :] behind the context (may end in INCOMPLETE)

    @property
    def text(self) -> str:
        return self.settled + self.pending

    def extend(self, tokens: list[int]) -> str:
        """Add `tokens`; returns the text of every token so far."""
        self.tokens += tokens
        window = self._decode(self.tokens[self.start :])
        if not window.startswith(self.context):  # not local here: decode everything once
            self.start, self.read, self.settled, self.context = 0, 0, "", ""
            window = self._decode(self.tokens)
        tail = window[len(self.context) :]
        if tail.endswith(INCOMPLETE):  # the last character's bytes are not all there: wait for the next tokens
            self.pending = tail
            return self.text
        self.settled += tail
        self.pending = ""
        self.read = len(self.tokens)
        if self.read - self.start > 2 * CONTEXT:
            self.start = self.read - CONTEXT
            self.context = self._decode(self.tokens[self.start : self.read])
        else:
            self.context = window
        return self.settled

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
