"""`auto`: the method that picks its drafter, round by round, from what pays on this model and machine.

Which method wins depends on the text (code and summaries repeat their prompt, open chat needs
a draft that predicts the model), on the hardware's cost curve and on load; no user should have
to know that. `auto` drafts, each round, with the candidate that promises the most tokens per
second (`drafters.auto.AutoDrafter`: the measured cost curve, and each candidate's acceptance and draft
time so far in this request, starting from the earlier requests'), or with none (a plain target
step) when nothing pays. The candidates (`use`) are:

- `lookup`: prompt lookup (`prompt-lookup`: what followed the latest earlier occurrence of the longest
  suffix), free to look up, so asked every round, priced by the figures of its offer's kind (the match's length)
  and scored whether it drafts or not; the default candidate;
- `context`: the request's own n-grams (`lookahead:context`: a 4-token guess after the root alone), free alike; not
  a default candidate any more. Beside `lookup` it cost more than it earned on the training prompts (chat and
  long documents) and on code written from the standard library, as chat and as raw completion (issue 41's
  note), and over the benchmark prompts once prompt lookup copied a short repeat whole, which it had offered cut
  short (HumanEval's completions loop with a short period: there the context's full 4-token guess had paid,
  issue 41's note); docs/benchmarks/smollm2-auto-lookup-xeon-amx has the two side by side. `use=context+lookup`
  (preset `with-context`) brings it back;
- `head`: the feature head's draft (`speculative:chain` with a head; `width` > 1: its EAGLE-2 tree), when
  there is a head; not a default candidate. On the 2-core CPUs measured, its rounds cost more than they
  earned once the lookups offered one short guess a round: `auto` without it was faster on the benchmark
  prompts (docs/benchmarks/smollm2-auto-candidates-xeon-amx) and on the training prompts (issue 41's note).
  `use=head+lookup` (preset `head`) brings it back: a better head, or hardware where a verified row is
  nearly free, may pay for it;
- `draft`: the draft model's chain under the cost policy (`speculative` with a draft model), not a default
  candidate either (it drafts worse than the head at a few times its cost: docs/benchmarks);
- `head+lookup` (and each such pair), with `merge=true`: the head's tree and the lookup's offer merged into one
  trie, verified in one forward, when the lookup has something. Off by default: in the q8 arithmetic it cost more
  than it earned (docs/benchmarks/smollm2-auto-merge-xeon-amx).

In a batch (`serve`, `Engine.generate_batch`) a draft is priced by the rows it adds to the shared
forward, so drafts shrink as the batch grows and stop where the forward's cost turns linear.
Self-speculative decoding is not a candidate: on a CPU's cost curve it has not paid in any run
(docs/benchmarks/smollm2-self-speculative).
Lossless like every method: switching changes who drafts, never what is accepted. The stats say
which drafter produced each round's tokens (`Stats.extra["auto_chunks"]`; `generate --explain`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from draftverify.costs import curve
from draftverify.drafters.auto import AutoDrafter, Figures
from draftverify.drafters.base import Drafter
from draftverify.drafters.draft_model import DraftModel
from draftverify.drafters.feature import TREE_WIDTHS, FeatureHeadDrafter
from draftverify.drafters.prompt_lookup import PromptLookup, PromptLookupConfig
from draftverify.errors import require
from draftverify.methods.base import Method, register
from draftverify.methods.lookahead import Lookahead, lookahead_drafter
from draftverify.methods.speculative import Speculative
from draftverify.models import Runner
from draftverify.policies import make_policy
from draftverify.session import Session

CANDIDATES = ("head", "draft", "context", "lookup")
DEFAULT_CANDIDATES = ["lookup"]  # the module docstring says why
# The most positions auto's head feeds when it catches up (at a request's start, and each time it comes back after
# sitting out; `speculative`'s feeds `drafters.feature.CATCH_UP`): a head that sits out and comes back often pays
# for each catch-up more than its attention over the older positions earns. Chosen on the training prompts against
# 128, 32 and 16 (issue 41's note: ad hoc, interleaved A/Bs), where it made auto a few percent faster and the head's
# acceptance in `speculative` about a point lower.
HEAD_CATCH_UP = 8


@dataclass(frozen=True)
class AutoConfig:
    """use: the candidates, joined by '+' (head, draft, context, lookup); "" = lookup (the module
       docstring says why the head and the draft model are not). A named candidate the engine lacks is skipped.
    probe: a candidate that sat out this many rounds it could have drafted drafts once (its figures stay current),
       unless even a round with all it verifies accepted would be slower than plain decoding (a busy batch).
    decay: the weight of the older rounds in each candidate's running means (lower: quicker to switch).
    merge: also weigh each model-run candidate's tree merged with a free candidate's offer (`head+lookup`),
       verified in one forward and priced by figures of its own. Off by default: each merged candidate is one more
       choice to probe, and its rounds (the head's chain beside an offer the lookup alone would have sent)
       cost more than they earned, in the bench (docs/benchmarks/smollm2-auto-merge-xeon-amx) and on the
       training prompts (issue 41's note).
    depth, width: the head's tree (`speculative`'s k and width): at most `depth` tokens deep, `width` children per
       expanded node (1 = a chain); its size still follows the cost curve. A chain by default: in auto's rounds
       a tree's wider expansions cost drafting time that its extra candidates must repay, which on a CPU's steep
       cost curve they rarely do (the runs in docs/benchmarks/smollm2-auto).
    margin: plain decoding drafts nothing only where it is faster than every candidate by more than this
       fraction of its rate (a bias toward drafting). 0 by default: the probes keep every candidate's figures
       current, plain decoding's included, and a bias of 0.1 drafted on where plain rounds were measured faster
       (docs/architecture.md#auto).
    measure: price each choice (plain decoding included) by the time its own rounds measured against the cost
       curve (`drafters.auto`); false: every choice by one running scale, as before that (compare the two in one
       bench run: `--methods 'autoregressive,auto,auto[measure=false]'`; its choices depend less on the clock).
    Each request starts from the figures the earlier requests of the same method instance left (the engine keeps
    one instance per spec; the bench's `warm=false` makes a fresh one per generation).
    """

    use: str = ""
    probe: int = 8
    decay: float = 0.7
    merge: bool = False
    depth: int = 6
    width: int = 1
    margin: float = 0.0
    measure: bool = True

    def __post_init__(self):
        unknown = next((c for c in self.names() if c not in CANDIDATES), None)
        require(
            unknown is None,
            f"unknown auto candidate {unknown!r}: use some of {', '.join(CANDIDATES)} joined by '+', e.g. "
            f"use=head+lookup",
        )
        require(self.probe >= 1, f"probe={self.probe} must be at least 1")
        require(0 <= self.decay < 1, f"decay={self.decay} must lie in [0, 1)")
        require(0 <= self.margin < 1, f"margin={self.margin} must lie in [0, 1)")
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
    uses_draft = True
    presets = {
        "no-context": {"use": "head+draft"},
        "context": {"use": "context"},
        "with-context": {"use": "context+lookup"},  # the default before issue 41's nineteenth session
        "head": {"use": "head+lookup"},
    }

    def __init__(self, target: Runner, draft=None, config=None, feature_head=None):
        super().__init__(target, draft, config, feature_head)
        self.figures = Figures()  # what this instance learnt: kept across its requests (warm start)

    @classmethod
    def drafts_with_model(cls, config, has_head: bool) -> bool:
        """Only when its candidates name the draft model, as `candidates` reads them."""
        return "draft" in (config.names() or DEFAULT_CANDIDATES)

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
        return out

    def drafter(self, s: Session) -> Drafter:
        return AutoDrafter(
            self.candidates(s),
            curve(self.target, widths=TREE_WIDTHS),
            self.figures,
            self.config.probe,
            self.config.decay,
            self.config.merge,
            self.config.margin,
            self.config.measure,
        )
