"""What every decoding method shares: a registry, configs with presets, and the prefill step."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from draftverify.errors import require
from draftverify.models import Runner
from draftverify.sampling import sample
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
    `presets` (named Config settings, e.g. the papers' hyperparameters) and `needs_draft`;
    optionally `aliases`, other names the method is found by.
    """

    name: ClassVar[str]
    Config: ClassVar[type] = NoConfig
    presets: ClassVar[dict[str, dict]] = {}
    needs_draft: ClassVar[bool] = False
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, target: Runner, draft: Runner | None = None, config=None):
        require(
            draft is not None or not self.needs_draft,
            f"method {self.name!r} needs a draft model: pass --draft (e.g. self:layers=8) or pick another method",
        )
        self.target = target
        self.draft = draft
        self.config = config if config is not None else self.Config()

    @classmethod
    def make_config(cls, preset: str | None = None, **overrides):
        """Build the config from a named preset plus explicit overrides (None values are ignored)."""
        values = {}
        if preset is not None:
            require(preset in cls.presets, f"unknown preset {preset!r} for {cls.name}: use one of {', '.join(cls.presets) or 'none'}")
            values.update(cls.presets[preset])
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        for key, value in overrides.items():
            require(key in fields, f"unknown option {key!r} for method {cls.name}: it takes {', '.join(sorted(fields)) or 'no options'}")
            if value is not None:
                values[key] = value
        return cls.Config(**values)

    @abstractmethod
    def run(self, s: Session) -> None:
        """Decode one request, handing accepted tokens to `s.emit` until it returns False."""

    # -- shared steps ---------------------------------------------------------------------

    def prefill(self, s: Session) -> torch.Tensor:
        """Reset the target cache, run the prompt, return the logits [V] for the first new token."""
        self.target.reset()
        with s.stats.timer("verify"):
            logits = self.target.forward(s.prompt, last=1).logits[-1]
        s.stats.target_forwards += 1
        return logits

    def pick(self, logits: torch.Tensor, s: Session, device: torch.device) -> int:
        """Next token from logits [V]: argmax when greedy, else a sample after the shared processing."""
        if s.sampling.greedy:
            return int(logits.argmax().item())
        return sample(s.sampling.probs(logits), s.generator(device))
