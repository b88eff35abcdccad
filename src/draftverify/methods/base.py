"""What every decoding method shares: a registry, configs with presets, what it drafts with, and the one round.

A method is a named configuration: its Config (with presets) says which drafter proposes and
how long its drafts are; `rounds` hands that drafter to `round.rounds`, the loop every method shares.
`Method.drafts(config)` declares, once, what it drafts with (`Drafts`): the engine hands it its draft by
that declaration, and the CLI, the server and the bench decide by it whether to load the default drafts.
"""

from __future__ import annotations

import dataclasses
from abc import ABC
from enum import Enum
from typing import ClassVar

from draftverify.drafters.base import Drafter
from draftverify.errors import require
from draftverify.models import Runner
from draftverify.round import Rounds, drive, rounds
from draftverify.session import Session

METHODS: dict[str, type["Method"]] = {}


def register(cls: type["Method"]) -> type["Method"]:
    """Add `cls` to `METHODS` under its name and under the other names it declares itself (not inherited)."""
    for name in (cls.name, *cls.__dict__.get("aliases", ())):
        METHODS[name] = cls
    return cls


class Artifact(Enum):
    """Something a method drafts with."""

    DRAFT_MODEL = "draft model"  # the engine's draft model (--draft): a small model, or the target's first layers
    FEATURE_HEAD = "feature head"  # the engine's feature head (EAGLE-style; the default model ships one)
    ACCEPTANCE_HEAD = "acceptance head"  # the method's own (SpecDec++), named by its config
    SKIP_SET = "skip set"  # the method's own: the target's sub-layers its draft skips (self-speculative)


ENGINE_ARTIFACTS = (Artifact.DRAFT_MODEL, Artifact.FEATURE_HEAD)  # what the engine loads and hands to methods


@dataclasses.dataclass(frozen=True)
class Drafts:
    """What a method drafts with: the one declaration the engine, the CLI, the server and the bench read.

    draft     what the engine hands the method as its draft, in order of preference: the first one the engine
              has (the feature head where it has one; the draft model, which may turn out to be absent)
    beside    what else it drafts with: the engine's feature head beside its draft (`auto`), or an artifact of its
              own (an acceptance head, a skip set), which it loads itself
    required  it cannot run without a draft (refused in one line); else it runs with what there is
    """

    draft: tuple[Artifact, ...] = ()
    beside: tuple[Artifact, ...] = ()
    required: bool = False

    def __post_init__(self):
        require(all(a in ENGINE_ARTIFACTS for a in self.draft), f"a draft is one of {ENGINE_ARTIFACTS}: {self.draft}")
        require(self.draft or not self.required, "a method that requires a draft names what it drafts with")

    def choose(self, has_head: bool) -> Artifact | None:
        """What the engine hands as the draft: the first of `draft` it has (`has_head`: it has a feature head)."""
        return next((a for a in self.draft if a is not Artifact.FEATURE_HEAD or has_head), None)

    @property
    def loads(self) -> bool:
        """Whether the engine's drafts (draft model, feature head) are worth loading for this method."""
        return any(a in ENGINE_ARTIFACTS for a in (*self.draft, *self.beside))

    def describe(self) -> str:
        """E.g. "drafts with the feature head or the draft model (required), beside an acceptance head"."""
        if not (self.draft or self.beside):
            return "drafts with nothing"
        what = " or ".join(f"the {a.value}" for a in self.draft)
        if self.draft:
            what = f"drafts with {what}" + (" (required)" if self.required else " when there is one")
        beside = ", ".join(f"the {a.value}" for a in self.beside)
        return f"{what}, beside {beside}" if what and beside else what or f"drafts with {beside}"


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """A method without settings."""


class Method(ABC):
    """A decoding method: `run(session)` decodes one request and emits its tokens.

    Subclasses set `name`, `Config` (a frozen dataclass validated in `__post_init__`),
    `presets` (named Config settings, e.g. the papers' hyperparameters) and `drafts_with` (what it
    drafts with, `Drafts`; a method whose declaration depends on its config overrides `drafts`);
    optionally `aliases`, other names the method is found by; and `drafter(s)`.
    """

    name: ClassVar[str]
    Config: ClassVar[type] = NoConfig
    presets: ClassVar[dict[str, dict]] = {}
    drafts_with: ClassVar[Drafts] = Drafts()
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, target: Runner, draft=None, config=None, feature_head=None):
        """`draft`: the draft the engine chose by `drafts` (a draft model's Runner or the feature head itself;
        `draft_source` says which, None without one); `feature_head`: the engine's feature head, if any, for a
        method that drafts with it beside a draft model (`auto`) or ranks a draft model's vocabulary by it."""
        self.config = config if config is not None else self.Config()
        require(
            draft is not None or not self.drafts(self.config).required,
            f"method {self.name!r} needs a draft model: pass --draft (e.g. self:layers=8) or pick another method",
        )
        self.target = target
        self.draft = draft
        self.feature_head = feature_head
        self.draft_source = (
            None if draft is None else Artifact.FEATURE_HEAD if draft is feature_head else Artifact.DRAFT_MODEL
        )

    @classmethod
    def drafts(cls, config=None) -> Drafts:
        """What an instance with `config` (None: the default one) drafts with: `drafts_with` unless it depends on
        the config."""
        return cls.drafts_with

    @classmethod
    def make_config(cls, preset: str | None = None, **overrides):
        """Build the config from a named preset plus explicit overrides (None values are ignored)."""
        values = {}
        if preset is not None:
            require(
                preset in cls.presets,
                f"unknown preset {preset!r} for {cls.name}: use one of {', '.join(cls.presets) or 'none'}",
            )
            values.update(cls.presets[preset])
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        for key, value in overrides.items():
            require(
                key in fields,
                f"unknown option {key!r} for method {cls.name}: it takes {', '.join(sorted(fields)) or 'no options'}",
            )
            if value is not None:
                values[key] = value
        return cls.Config(**values)

    def share(self, first: "Method") -> None:
        """This instance serves another batch slot than `first` (slot 0's, same config): share whatever warm state
        should outlive a request across slots (a phrase pool, `auto`'s figures). Nothing by default."""

    def warm_state(self):
        """A copy of what this instance carries from one request into the next (its warm start: a phrase pool,
        `auto`'s figures), for `restore_warm_state`; None where it carries nothing."""
        return None

    def restore_warm_state(self, state) -> None:
        """Start the next request from `state` (a `warm_state` taken earlier) instead of what the requests since
        left: the bench gives every repeat of a prompt the start its first repeat had. In place, so the batch
        slots that share this instance's state (`share`) see it too."""

    def draft_model(self) -> Runner:
        """The draft model's runner, refusing a feature head (for methods that draft with a model of their own)."""
        require(
            self.draft_source is Artifact.DRAFT_MODEL,
            f"method {self.name!r} needs a draft model, not a feature head: pass --draft "
            "with a model folder (e.g. --draft self:layers=8), or use speculative / ouroboros",
        )
        return self.draft

    def draft_vocab(self, n: int):
        """FR-Spec: the `n` tokens the target most often replies with, for a draft model or a layer-skip draft to
        draft from (`DraftModel`'s `vocab`), as the engine's feature head ranks them (its vocabulary is the
        target's reply tokens, most frequent first); None (the whole vocabulary) for n = 0 or without a feature
        head."""
        return None if not n or self.feature_head is None else self.feature_head.vocab[:n]

    def drafter(self, s: Session) -> Drafter | None:
        """What proposes candidates for request `s` (None: nothing, plain autoregressive decoding)."""
        return None

    def rounds(self, s: Session) -> Rounds:
        """Request `s`'s decoding as a generator of target forwards (`round.rounds`): a subclass with set-up
        or clean-up around a request overrides this, and both `run` and a batch (`batch.Batch`) use it."""
        return rounds(s, self.target, self.drafter(s))

    def run(self, s: Session) -> None:
        """Decode one request, handing accepted tokens to `s.emit` until it returns False."""
        drive(self.rounds(s), self.target)


def standalone_method(name: str, drafter: type[Drafter], config: type, presets: dict) -> type[Method]:
    """The method that runs a standalone drafter (`drafters.base.standalone`) built from its config."""

    def make(self, s: Session) -> Drafter:
        return drafter(self.config)

    doc = f"Drafting with `{drafter.__module__}.{drafter.__name__}`."
    return type(
        drafter.__name__ + "Method",
        (Method,),
        {"name": name, "Config": config, "presets": presets, "drafter": make, "__doc__": doc},
    )
