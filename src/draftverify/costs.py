"""Measured forward costs: how long one forward of w new tokens takes on the path in use.

The cost curve t(w) is what every draft-length and tree-size decision trades against: on a
GPU, or on the static CPU path, verifying 8 tokens costs little more than 1, while on the
eager CPU path it costs 1.7x (see docs/backends.md). `forward_times` measures it (fastest of
`reps` runs per width after a fixed context); `curve(model, backend)` measures it once per
model and backend in a process and keeps it; `forward_time` reads it between the widths.
"""

from __future__ import annotations

import time
import weakref

import torch

from draftverify.models import Runner

WIDTHS = (1, 2, 4, 8, 16, 32)
POLICY_CONTEXT = 64  # tokens of context before the policy's timed forwards
_CURVES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_times(
    model: torch.nn.Module, context: list[int], widths=WIDTHS, reps: int = 5, all_logits: bool = True, backend: str = "auto"
) -> dict[int, float]:
    """Seconds of one forward of w new tokens after `context`, for each w in `widths`: the
    fastest of `reps` runs (the least disturbed by the rest of the machine).

    `all_logits`: compute logits for every new token (the target verifying drafts) or only
    the last one (the draft proposing).
    """
    runner = Runner(model, backend)
    runner.forward(context, last=1)
    base = runner.length

    def forward(tokens: list[int]) -> None:
        runner.forward(tokens, last=None if all_logits else 1)
        sync_device(runner.device)

    return time_widths(forward, lambda: runner.crop(base), context, widths, reps)


def time_widths(forward, rollback, context: list[int], widths=WIDTHS, reps: int = 5) -> dict[int, float]:
    """Seconds of `forward(tokens)` for w tokens (taken from `context`, repeated), per w in `widths`:
    the fastest of `reps` runs after a warm-up, `rollback()` after each. Any engine's forward."""
    tokens = (context * (max(widths) // max(1, len(context)) + 1))[: max(widths)]
    times = {}
    for w in widths:
        samples = []
        for rep in range(reps + 1):  # the first run of each width is a warm-up
            t = time.perf_counter()
            forward(tokens[:w])
            if rep:
                samples.append(time.perf_counter() - t)
            rollback()
        times[w] = min(samples)
    return times


def curve(runner: Runner, all_logits: bool = True, widths=(1, 2, 4, 8, 16)) -> dict[int, float]:
    """The cost curve of `runner`'s model on its backend, measured once per process (3 runs a width)."""
    key = (runner.backend, all_logits, tuple(widths))
    found = _CURVES.setdefault(runner.model, {})
    if key not in found:
        vocab = runner.model.get_input_embeddings().weight.shape[0]
        context = [(7 * i + 3) % vocab for i in range(POLICY_CONTEXT)]
        found[key] = forward_times(runner.model, context, widths, reps=3, all_logits=all_logits, backend=runner.backend)
    return found[key]


def forward_time(table: dict[int, float], width: int) -> float:
    """t(width) from a table of measured widths: linear between points, extended linearly beyond."""
    points = sorted((int(w), t) for w, t in table.items())
    if len(points) == 1:
        return points[0][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if width <= w1 or (w1, t1) == points[-1]:
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
    raise AssertionError("unreachable")


def marginal_time(table: dict[int, float], width: int, others: int = 0) -> float:
    """Seconds `width` rows add to a forward that carries `others` rows of other sequences (a batch); alone
    (others = 0) that is t(width). Never below a twentieth of t(1) per row: a measured curve can dip."""
    if others <= 0:
        return forward_time(table, width)
    floor = 0.05 * width * forward_time(table, 1)
    return max(forward_time(table, others + width) - forward_time(table, others), floor)
