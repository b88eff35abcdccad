"""What every decoding method shares: a registry, configs with presets, and the one round.

A method is a named configuration: its Config (with presets) says which drafter proposes and
how long its drafts are; `rounds` hands that drafter to `round.rounds`, the loop every method shares.
"""

from __future__ import annotations

import dataclasses
from abc import ABC
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


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """A method without settings."""


class Method(ABC):
    """A decoding method: `run(session)` decodes one request and emits its tokens.

    Subclasses set `name`, `Config` (a frozen dataclass validated in `__post_init__`),
    `presets` (named Config settings, e.g. the papers' hyperparameters) and `needs_draft` (a
    draft: a draft model's Runner or a `FeatureHead`; `draft_source` says which);
    optionally `aliases`, other names the method is found by; and `drafter(s)`.
    """

    name: ClassVar[str]
    Config: ClassVar[type] = NoConfig
    presets: ClassVar[dict[str, dict]] = {}
    needs_draft: ClassVar[bool] = False
    takes_head: ClassVar[bool] = False  # drafts with a feature head (FeatureHead) when the engine has one
    uses_draft: ClassVar[bool] = False  # drafts with the engine's draft model or head when it has them, needing neither
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, target: Runner, draft=None, config=None, feature_head=None):
        """`draft`: the draft (see `needs_draft`); `feature_head`: the engine's feature head, if any, for a method that
        may use it beside a draft model (`auto`). The engine hands the feature head itself as `draft` to a method
        that `takes_head`: `draft_source` is then "feature head", else "model" (or None without a draft)."""
        require(
            draft is not None or not self.needs_draft,
            f"method {self.name!r} needs a draft model: pass --draft (e.g. self:layers=8) or pick another method",
        )
        self.target = target
        self.draft = draft
        self.feature_head = feature_head
        self.config = config if config is not None else self.Config()
        self.draft_source = None if draft is None else "feature head" if draft is feature_head else "model"

    @classmethod
    def loads_draft(cls) -> bool:
        """Whether the default drafts are worth loading for this method (it needs or may use them)."""
        return cls.needs_draft or cls.uses_draft

    @classmethod
    def drafts_with_head(cls, config, has_head: bool) -> bool:
        """Whether an instance with `config` is handed the engine's feature head as its draft, the engine having
        one (`has_head`) or not."""
        return cls.takes_head and has_head

    @classmethod
    def drafts_with_model(cls, config, has_head: bool) -> bool:
        """Whether an instance with `config` drafts with the engine's draft model (which the engine then loads), the
        engine having a feature head (`has_head`) or not. A method handed the head drafts with it instead."""
        return cls.loads_draft() and not cls.drafts_with_head(config, has_head)

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
            self.draft_source == "model",
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
