"""The grammar's own text as a draft: where a request's structured output (`response_format`, tools) allows only
one continuation for a while (a JSON schema's next key, its quotes and colon), propose it.

No model runs: the request's grammar matcher already knows the forced bytes (`constraints.Grammar.forced`), and the
tokenizer writes them as tokens. The model may spell the same bytes in other tokens, so they are verified like any
draft, and a request without a grammar gets no proposal. `auto` asks it every round beside its other free candidates.
"""

from __future__ import annotations

from draftverify.drafters.base import Drafter, Proposal
from draftverify.session import Session


class GrammarText(Drafter):
    free = True
    label = "grammar"

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        grammar = getattr(s.processor, "grammar", None)
        if grammar is None or room <= 0:
            return Proposal()
        tokens = grammar.forced(s.output)[:room]
        return Proposal([tokens], kind="forced") if tokens else Proposal()
