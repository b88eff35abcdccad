"""SpecDec++: speculative decoding whose draft length is decided by a trained acceptance head.

Huang et al. 2024, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths".
Method `specdec-pp`, also reachable as `specdec++` (`+` is not allowed in bench method specs). Each round is the
`speculative` round (the draft model drafts a chain, the shared round verifies it) with one change:
1. after each drafted token the head reads the draft's hidden state and predicts p_hat, the
   chance that the previous draft is accepted (drafters/acceptance_head.py, `AcceptanceHeadPolicy`);
2. drafting stops as soon as 1 - prod(p_hat) > h, or at the hard cap of 20 tokens;
3. verification is unchanged, so output stays identical (greedy) or exactly distributed (sampling).

What drafts (`drafter`): the engine's feature head when it has one (the default model ships one), as
`speculative` drafts with it; else, or with `drafter=model`, the draft model, as in the paper. Over the head the
round drafts one chain of the head's most likely tokens and the acceptance head reads the head's predicted
feature that produced each draft (`drafters.feature.FeatureHeadDrafter` with a policy); its head file is trained
for that head (`train-acceptance-head --draft HEAD_FOLDER`). A choice of this project, not the paper's: where a
verified row costs a share of a step (a CPU), the paper's separate draft model is accepted too seldom for any
stopping rule to pay (docs/specdec.md).

Method `ouroboros-pp` is Ouroboros with the same head as its drafting stop rule: the draft's
phrase-by-phrase sentence draft ends at the first drafted token where 1 - prod(p_hat) > h
(checked per token, also inside a phrase), instead of at gamma tokens.

The head is trained per draft/target pair (`draftverify train-acceptance-head`); `head=default` takes, over a
feature head, the draft store's head trained for it (`draftverify build-drafts`, `loading.store`), else the head
shipped for the default pair; a head made for another pair is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from draftverify.drafters.acceptance_head import DEFAULT_CAP, DEFAULT_H, AcceptanceHead, AcceptanceHeadPolicy, load_head
from draftverify.drafters.base import Drafter
from draftverify.drafters.draft_model import DraftModel
from draftverify.drafters.feature import DRAFT_VOCAB, FeatureHeadDrafter
from draftverify.errors import DraftVerifyError, MissingDrafts, require
from draftverify.loading import model_identity
from draftverify.loading.hf import model_source
from draftverify.loading.store import find, missing
from draftverify.methods.base import Artifact, Drafts, Method, register
from draftverify.methods.ouroboros import Ouroboros, OuroborosConfig
from draftverify.session import Session

SHIPPED_HEADS = Path(__file__).parent.parent / "assets" / "specdec-heads"
DEFAULT_HEAD = "default"
FEATURE_HEAD_DEFAULT = "feature"  # the shipped head for the default model's feature head
DRAFTERS = ("head", "model")
# h over a feature head unless told otherwise: chosen on the development prompts in q8 (docs/specdec.md): where a
# verified row costs a share of a step, a chain stopped at the first doubtful draft pays more than a longer one.
HEAD_H = 0.3
THRESHOLD_PRESETS = {f"h0.{h}": {"h": h / 10} for h in (1, 3, 5, 7, 9)}  # the paper's grid for h


@dataclass(frozen=True)
class SpecDecPPConfig:
    """h: stop drafting once the predicted chance that a drafted token is rejected exceeds h (unset: 0.7, the
       paper's, over a draft model; 0.3 over a feature head, `HEAD_H`).
    cap: hard cap on drafted tokens per round (20 in the paper).
    head: a head file made by `draftverify train-acceptance-head`, or the name of a head shipped in
          assets/specdec-heads/ (`default`: the one shipped for what drafts, `feature` over the default model's
          feature head and `default` over its draft model).
    vocab: draft only from the target's `vocab` most frequent reply tokens (FR-Spec, `Method.draft_vocab`; 0 = all
          of them): a draft forward then reads that many rows of the LM head.
    drafter: `head`: the engine's feature head where it has one, else the draft model; `model`: the draft model."""

    h: float | None = None
    cap: int = DEFAULT_CAP
    head: str = DEFAULT_HEAD
    vocab: int = DRAFT_VOCAB
    drafter: str = "head"

    def __post_init__(self):
        check_head_settings(self.h, self.cap)
        require(self.vocab >= 0, f"vocab={self.vocab} must be >= 0")
        require(self.drafter in DRAFTERS, f"drafter={self.drafter!r}: use one of {', '.join(DRAFTERS)}")


class HeadStops:
    """The stopping rule of a method whose Config has `head`, `h` and `cap`: the pair's acceptance head."""

    _head: AcceptanceHead | None = None

    def make_policy(self) -> AcceptanceHeadPolicy:
        if self._head is None:  # loaded once, checked against this draft/target pair
            over_head = self.draft_source is Artifact.FEATURE_HEAD
            drafts = self.draft if over_head else self.draft_model().model
            draft_identity = drafts.identity if over_head else model_identity(drafts)
            target_identity, default = model_identity(self.target.model), self.config.head == DEFAULT_HEAD
            # `default` over a feature head: the draft store's head trained for it (`loading.store`), else shipped
            stored = (
                over_head
                and default
                and find(target_identity, self.target.shared.packs.arithmetic, "acceptance", draft_identity)
            )
            try:
                target = model_source(self.target.model)
                head = load_head(
                    stored or resolve_head(self.config.head, over_head), draft_identity, target_identity, target
                )
            except DraftVerifyError as exc:  # none shipped for this pair either: say how to build one
                if stored or not default or getattr(self.config, "drafter", "model") != "head":
                    raise
                what = "acceptance" if over_head else "head"  # the engine has no feature head: build one, and its
                raise MissingDrafts(missing(what, target)) from exc
            self._head = head.to(self.draft.fc.weight.device if over_head else self.draft.device)
        h = self.config.h
        if h is None:
            h = HEAD_H if self.draft_source is Artifact.FEATURE_HEAD else DEFAULT_H
        return AcceptanceHeadPolicy(self._head, h, self.config.cap)


@register
class SpecDecPP(HeadStops, Method):
    name = "specdec-pp"
    aliases = ("specdec++",)  # the name; bench specs cannot hold "+"
    Config = SpecDecPPConfig
    drafts_with = Drafts((Artifact.FEATURE_HEAD, Artifact.DRAFT_MODEL), (Artifact.ACCEPTANCE_HEAD,), required=True)
    presets = {"paper": {"h": 0.7, "cap": 20}, **THRESHOLD_PRESETS}  # paper: best overall, with a w_rej = 6 head

    @classmethod
    def drafts(cls, config=None) -> Drafts:
        if config is None or config.drafter == "head":
            return cls.drafts_with
        return replace(cls.drafts_with, draft=(Artifact.DRAFT_MODEL,))

    def drafter(self, s: Session) -> Drafter:
        if self.draft_source is Artifact.FEATURE_HEAD:
            c = self.config
            return FeatureHeadDrafter(self.draft, self.target, depth=c.cap, vocab=c.vocab, policy=self.make_policy())
        return DraftModel(self.draft_model(), self.make_policy(), vocab=self.draft_vocab(self.config.vocab))


@dataclass(frozen=True)
class OuroborosPPConfig(OuroborosConfig):
    """Ouroboros settings (see `ouroboros`) with the SpecDec++ head deciding the sentence draft's
    length: h, cap and head as in `specdec-pp`; gamma, policy and threshold are not used."""

    h: float = DEFAULT_H
    cap: int = DEFAULT_CAP
    head: str = DEFAULT_HEAD

    def __post_init__(self):
        super().__post_init__()
        check_head_settings(self.h, self.cap)


@register
class OuroborosPP(HeadStops, Ouroboros):
    name = "ouroboros-pp"
    Config = OuroborosPPConfig
    presets = {**Ouroboros.presets, **THRESHOLD_PRESETS}

    # its sentence draft is the draft model's, phrase by phrase, the acceptance head reading its states
    drafts_with = Drafts((Artifact.DRAFT_MODEL,), (Artifact.ACCEPTANCE_HEAD,), required=True)


def check_head_settings(h: float | None, cap: int) -> None:
    require(h is None or 0 < h < 1, f"h={h} must lie strictly between 0 and 1 (the paper tries 0.1..0.9)")
    require(1 <= cap <= 64, f"cap={cap} must lie in 1..64")


def shipped_heads() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SHIPPED_HEADS.glob("*.safetensors"))}


def resolve_head(name: str, over_head: bool = False) -> Path:
    """A path to a head file, or the name of a shipped head; `default` names the one for what drafts (`over_head`:
    the default model's feature head)."""
    if name.endswith(".safetensors") or "/" in name:
        return Path(name).expanduser()
    if name == DEFAULT_HEAD and over_head:
        name = FEATURE_HEAD_DEFAULT
    heads = shipped_heads()
    require(
        name in heads,
        f"no shipped acceptance head named {name!r} (shipped: {', '.join(heads) or 'none'}): "
        "pass head=PATH to a file made by `draftverify train-acceptance-head`",
    )
    return heads[name]
