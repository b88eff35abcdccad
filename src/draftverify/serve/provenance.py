"""Who drafted each streamed token: the `x_draftverify` extension of stream chunks (the web page colours by it).

A streamed request asks with `"draftverify": {"provenance": true}`. For every chunk of tokens it emits, the round
records who drafted its leading accepted tokens (`Drafter.sources` into `Session.drafted_by`: the drafter of the
method, or for `auto` the candidate that drafted that round); the chunk's other token (a round's bonus or
correction token, a plain step's token, the first token after the prefill) is the target's own, `by` null. Each
streamed chunk with text then carries

    "x_draftverify": {"tokens": [{"text": "...", "by": "prompt-lookup" | null}, ...],
                      "drafted": D, "accepted": A, "target_forwards": F, "new_tokens": N}

`tokens` are the tokens whose text the chunk's delta holds, their texts adding up to the delta exactly: a token whose
text the stream holds back (an incomplete character, a possible stop string) comes with the chunk that sends it, a
token that completes a character carries the whole character, and a token cut by a stop string carries its part
before the stop. D, A, F and N are the request's running counts (drafted and accepted candidate tokens, target
forwards, tokens emitted, a token of no text such as the end of the reply included; docs/metrics.md). Provenance
only reads what the round knew: the tokens are the same with or without it.
"""

from __future__ import annotations

from draftverify.detokenize import Detokenizer
from draftverify.serve.protocol import ApiError


def wanted(req) -> bool:
    """Whether the request asks for provenance; only a stream carries it (a 400 otherwise)."""
    if req.draftverify is None or not req.draftverify.provenance:
        return False
    if not req.stream:
        raise ApiError(
            400,
            "draftverify.provenance comes with stream chunks: send stream: true, or drop it",
            param="draftverify",
            code="invalid_value",
        )
    return True


def tally(session, n: int) -> dict:
    """Who drafted each of the `n` tokens the session emits now (None: the target), and its running counts."""
    drafted_by, stats = session.drafted_by, session.stats
    return {
        "by": [drafted_by[i] if i < len(drafted_by) else None for i in range(n)],
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "target_forwards": stats.target_forwards,
        "new_tokens": len(session.output),
    }


class Marks:
    """One choice's tokens with their drafters, cut into the streamed deltas (`take`) token by token."""

    def __init__(self, tokenizer):
        self.decoded = Detokenizer(tokenizer)
        self.ends: list[int] = []  # the length of the settled text after each token
        self.by: list[str | None] = []
        self.sent = 0  # the length of the text sent so far
        self.next = 0  # the first token whose text is not all sent
        self.counts: dict = {}

    def push(self, tokens: list[int], tally: dict) -> None:
        """Tokens just emitted and their `tally`: each token's text ends where the text settled once it came."""
        for token, by in zip(tokens, tally["by"]):
            self.decoded.extend([token])
            end = len(self.decoded.settled)  # not a character whose bytes are still to come
            self.ends.append(max(end, self.ends[-1] if self.ends else 0))
            self.by.append(by)
        self.counts = {k: v for k, v in tally.items() if k != "by"}

    def take(self, delta: str) -> dict:
        """The chunk's extension for `delta`, the next text sent: the tokens that delta holds."""
        start, stop = self.sent, self.sent + len(delta)
        out = []
        while self.next < len(self.ends) and start < stop:
            end = min(self.ends[self.next], stop)
            if end > start:
                out.append({"text": delta[start - self.sent : end - self.sent], "by": self.by[self.next]})
                start = end
            if self.ends[self.next] > stop:
                break
            self.next += 1
        if start < stop:  # text past every token's (not expected: the deltas are the tokens' text); the target's
            out.append({"text": delta[start - self.sent :], "by": None})
        self.sent = stop
        return {"x_draftverify": {"tokens": out, **self.counts}}
