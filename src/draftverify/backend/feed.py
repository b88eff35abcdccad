"""What one forward of a decoder is asked (`Feed`) and what it gives back (`Forward`).

Every path that runs a model token by token speaks these two types: `step.prepare_step` builds a
`Feed`, `round.rounds` yields it, `models.Runner` or `models.forward_many` runs it on a backend
(`backend.eager.EagerDecoder` or `backend.decoder.StaticDecoder`) and `step.finish_step` reads the
`Forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Feed:
    """New tokens for one sequence's cache.

    tokens: [n] token ids (a list or a tensor), appended after the cache's `length` tokens.
    positions: [n] position ids (None: the next n positions, causal attention).
    tree_mask: [n, n] bool, True = new token i may attend new token j (None: causal); every new
        token attends the whole cached prefix, within each layer's sliding window.
    last: logits for the last `last` new tokens only (None: all n).
    hidden: also return the final hidden states (after the final norm) of those rows, or of every
        new token for "all".
    skip: a drafters.skipsets.SkipSet whose sub-layers the forward bypasses (self-speculative drafting).
    vocab: [N] token ids (a draft's FR-Spec vocabulary): logits are formed for these tokens only, on a rounded copy of
        their LM-head rows, and every other token's logit is -inf. For drafting only: it changes what a draft
        proposes, never what the target verifies.
    """

    tokens: list[int] | torch.Tensor
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    last: int | None = None
    hidden: bool | str = False
    skip: object = None
    vocab: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """n, the number of new tokens (rows this feed adds to a forward)."""
        return len(self.tokens)


@dataclass
class Forward:
    """What a forward returns: logits [m, V] and, when asked, final hidden states [m, H] (or [n, H] for "all")."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
