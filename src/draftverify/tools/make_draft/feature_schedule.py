"""The feature head's training schedule (`make-draft --kind head`): the batch, the number of optimiser steps, the
learning rate at each step and when the head is evaluated.

Small data still gets many updates: the batch shrinks until an epoch has MIN_EPOCH_STEPS steps (`batch_tokens`
stays the cap, so large data batches as before). The schedule fills the time it has: the first TIMED_STEPS steps
are timed, then its length becomes the steps that fit before the deadline, at most `epochs` epochs. A resumed
build reads both from its checkpoint, so it continues the schedule an uninterrupted build would have followed.
"""

from __future__ import annotations

import math

from draftverify.tools.make_draft.feature_settings import HeadTraining

MIN_EPOCH_STEPS = 64  # an epoch has at least this many optimiser steps (unless a step would hold under max_len tokens)
TIMED_STEPS = 3  # steps timed before the schedule's length is fixed
PLANNED_SHARE = 0.9  # of the time left, what the planned steps may take: evaluations and checkpoints take the rest


def epoch_batch_tokens(sequences: list, config: HeadTraining) -> int:
    """The padded tokens a step may hold for these sequences: `config.batch_tokens`, shrunk (never below `max_len`)
    so that an epoch has at least MIN_EPOCH_STEPS batches. A batch holds at most that many of the sequences' tokens,
    so there are at least (their tokens) / (the batch) of them."""
    tokens = sum(min(len(s.ids), config.max_len) for s in sequences)
    return max(config.max_len, min(config.batch_tokens, tokens // MIN_EPOCH_STEPS))


def schedule_length(epoch_steps: int, epochs: float, step: int, seconds_per_step: float, seconds_left: float) -> int:
    """The schedule's length once `step` steps are done: `step` plus the steps that fit PLANNED_SHARE of the time
    left at `seconds_per_step`, at most `epochs` epochs of `epoch_steps` (and at least one step past `step`)."""
    cap = max(1, int(epochs * epoch_steps))
    fit = step + int(PLANNED_SHARE * max(0.0, seconds_left) / max(seconds_per_step, 1e-9))
    return min(cap, max(step + 1, fit))


def warmup_steps(config: HeadTraining, total: int) -> int:
    """The linear warm-up's length: `config.warmup`, at most a tenth of the schedule, at least one step."""
    return max(1, min(config.warmup, total // 10))


def learning_rate(config: HeadTraining, step: int, total: int) -> float:
    """Linear warm-up (`warmup_steps`), then a cosine from the peak down to a tenth of it at `total`."""
    rise = min(1.0, (step + 1) / warmup_steps(config, total))
    return config.lr * rise * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, total) / total)))


def eval_every(total: int) -> int:
    """Steps between held-out evaluations: about twenty over the schedule, at least ten steps apart."""
    return max(10, total // 20)


def expected_chain(top1: list[float]) -> float:
    """Tokens a greedy chain is expected to accept a round (before the bonus token), from top-1 rates by depth."""
    return sum(math.prod(top1[:d]) for d in range(1, len(top1) + 1))
