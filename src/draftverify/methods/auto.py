"""`auto`: the method that picks its drafter, round by round, from what pays on this model and machine.

Which drafter wins depends on the text (code and summaries repeat their prompt, open chat needs a draft that
predicts the model), on the hardware's cost curve and on load; no user should have to know that. `auto`
drafts, each round, with the candidate that promises the most tokens per second (`drafters.auto.AutoDrafter`),
or with none (a plain target step) when nothing pays. The candidates (`use`) are:

- `lookup`: prompt lookup (`prompt-lookup`), free to look up; a default candidate;
- `grammar`: the text a request's structured output forces next (`drafters.grammar`), free alike; a default
  candidate, present only in a request with a `response_format` or tools;
- `context`: the request's own n-grams (`lookahead:context`), free alike; preset `with-context` adds it;
- `head`: the feature head's draft (`speculative` with a head; `width` > 1: its tree), when there is a head;
  preset `head` adds it (a better head, or hardware where a verified row is nearly free, may pay for it);
- `draft`: the draft model's chain under the cost policy (`speculative` with a draft model).

In a batch (`serve`, `Engine.generate_batch`) a draft is priced by the rows it adds to the shared forward, so
drafts shrink as the batch grows and stop where the forward's cost turns linear. Lossless like every method:
switching changes who drafts, never what is accepted. The stats say which drafter produced each round's tokens
(`Stats.extra["auto_chunks"]`; `generate --explain`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from draftverify.costs import curve
from draftverify.drafters.auto import AutoDrafter
from draftverify.drafters.auto_figures import Figures
from draftverify.drafters.base import Drafter
from draftverify.drafters.draft_model import DraftModel
from draftverify.drafters.feature import TREE_WIDTHS, FeatureHeadDrafter
from draftverify.drafters.grammar import GrammarText
from draftverify.drafters.prompt_lookup import PromptLookup, PromptLookupConfig
from draftverify.errors import require
from draftverify.methods.base import Artifact, Drafts, Method, register
from draftverify.methods.lookahead import Lookahead, lookahead_drafter
from draftverify.methods.speculative import Speculative
from draftverify.models import Runner
from draftverify.policies import make_policy
from draftverify.session import Session

CANDIDATES = ("head", "draft", "context", "lookup", "grammar")
# beside these the others cost more than they earned on the CPUs measured (grammar drafts only under a grammar)
DEFAULT_CANDIDATES = ["lookup", "grammar"]
# The most positions auto's head feeds when it catches up (at a request's start, and each time it comes back after
# sitting out; `speculative`'s feeds `drafters.feature.CATCH_UP`): a head that sits out and comes back often would
# pay for each catch-up more than its attention over the older positions earns.
HEAD_CATCH_UP = 8


@dataclass(frozen=True)
class AutoConfig:
    """use: the candidates, joined by '+' (head, draft, context, lookup, grammar); "" = lookup+grammar. A named
       candidate the engine (or the request: grammar) lacks is skipped.
    probe: a candidate that sat out this many rounds it could have drafted drafts once (its figures stay current),
       unless even a round with all it verifies accepted would be slower than plain decoding (a busy batch).
    depth, width: the head's tree (`speculative`'s k and width): at most `depth` tokens deep, `width` children per
       expanded node (1 = a chain, the default: on a CPU's steep cost curve a tree's extra drafting rarely pays);
       its size still follows the cost curve.
    Each request starts from the figures the earlier requests of the same method instance left (the engine keeps
    one instance per spec; the bench's `warm=false` makes a fresh one per generation).
    """

    use: str = ""
    probe: int = 8
    depth: int = 6
    width: int = 1

    def __post_init__(self):
        unknown = next((c for c in self.names() if c not in CANDIDATES), None)
        require(
            unknown is None,
            f"unknown auto candidate {unknown!r}: use some of {', '.join(CANDIDATES)} joined by '+', e.g. "
            f"use=head+lookup",
        )
        require(self.probe >= 1, f"probe={self.probe} must be at least 1")
        require(
            1 <= self.depth <= 64 and 1 <= self.width <= 64,
            f"depth={self.depth} and width={self.width} must lie in 1..64",
        )

    def names(self) -> list[str]:
        return [c.strip() for c in self.use.split("+") if c.strip()]


@register
class Auto(Method):
    name = "auto"
    Config = AutoConfig
    presets = {"with-context": {"use": "context+lookup+grammar"}, "head": {"use": "head+lookup+grammar"}}

    def __init__(self, target: Runner, draft=None, config=None, feature_head=None):
        super().__init__(target, draft, config, feature_head)
        self.figures = Figures()  # what this instance learnt: kept across its requests (warm start)

    @classmethod
    def drafts(cls, config=None) -> Drafts:
        """What its candidates name, as `candidates` reads them; it runs with what there is."""
        use = (config or cls.Config()).names() or DEFAULT_CANDIDATES
        model = (Artifact.DRAFT_MODEL,) if "draft" in use else ()
        return Drafts(model, (Artifact.FEATURE_HEAD,) if "head" in use else ())

    def share(self, first: "Auto") -> None:
        self.figures = first.figures  # one set of figures for every batch slot

    def warm_state(self) -> Figures:
        return copy.deepcopy(self.figures)

    def restore_warm_state(self, state: Figures) -> None:
        self.figures.records, self.figures.scale = copy.deepcopy(state.records), state.scale
        self.figures.scales = dict(state.scales)

    def candidates(self, s: Session) -> dict[str, Drafter]:
        has_draft = isinstance(self.draft, Runner)
        use = self.config.names() or DEFAULT_CANDIDATES
        out: dict[str, Drafter] = {}
        if "head" in use and self.feature_head is not None:
            out["head"] = FeatureHeadDrafter(
                self.feature_head, self.target, depth=self.config.depth, width=self.config.width, catch_up=HEAD_CATCH_UP
            )
        if "draft" in use and has_draft:
            c = Speculative.make_config()  # the draft model's chain as `speculative` drafts it by default
            policy = make_policy(c.policy, c.k, c.threshold, self.target, self.draft)
            out["draft"] = DraftModel(self.draft, policy, vocab=self.draft_vocab(c.vocab))
        if "context" in use:
            out["context"] = lookahead_drafter(Lookahead.make_config("context"))
        if "lookup" in use:
            out["lookup"] = PromptLookup(PromptLookupConfig())
        if "grammar" in use and getattr(s.processor, "grammar", None) is not None:
            out["grammar"] = GrammarText()
        return out

    def drafter(self, s: Session) -> Drafter:
        return AutoDrafter(self.candidates(s), curve(self.target, widths=TREE_WIDTHS), self.figures, self.config.probe)
