"""Timing forwards: seconds of one forward of w new tokens after a context, per width, on a fork of a runner."""

from __future__ import annotations

import time

import torch

from draftverify.models import Runner

WIDTHS = (1, 2, 4, 8, 16, 32)
QUICK_RUNS = 3  # runs of each width in `time_once`: a warm-up, then two timed
TIMING = 4  # how `time_widths` times (in the curves' key: a file measured the old way, widths in turn, is not read)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_times(
    runner: Runner,
    context: list[int],
    widths=WIDTHS,
    reps: int = 5,
    all_logits: bool = True,
    quick: bool = False,
    known: dict[int, list[float]] | None = None,
) -> dict[int, float]:
    """Seconds of one forward of w new tokens after `context`, for each w in `widths`, on a fork of `runner` (its
    model on its path: a drafting runner's forward is timed as it drafts): the fastest of `reps` runs (the least
    disturbed by the rest of the machine); `quick`: the faster of two runs each, up to where the cost turns linear
    (`time_once`, `reps` unread).

    `all_logits`: compute logits for every new token (the target verifying drafts) or only
    the last one (the draft proposing). `known` (quick only): seconds per width timed already.
    """
    runner = runner.fork()
    runner.forward(context, last=1)
    base = runner.length

    def forward(tokens: list[int]) -> None:
        runner.forward(tokens, last=None if all_logits else 1)
        sync_device(runner.device)

    if quick:
        return time_once(forward, lambda: runner.crop(base), context, widths, known)
    return time_widths(forward, lambda: runner.crop(base), context, widths, reps)


def _tokens(context: list[int], widths) -> list[int]:
    """The widest forward's tokens, taken from `context` (repeated)."""
    return (context * (max(widths) // max(1, len(context)) + 1))[: max(widths)]


def _rising(samples: dict[int, list[float]]) -> dict[int, float]:
    """The fastest sample per width, a wider forward never taken as cheaper than a narrower one (what noise is left
    goes that way)."""
    times, floor = {}, 0.0
    for w in sorted(samples):
        times[w] = floor = max(floor, min(samples[w]))
    return times


def time_widths(forward, rollback, context: list[int], widths=WIDTHS, reps: int = 5) -> dict[int, float]:
    """Seconds of `forward(tokens)` for w tokens (taken from `context`, repeated), per w in `widths`:
    the fastest of `reps` runs after a warm-up, `rollback()` after each. Any engine's forward.

    The widths take turns, two runs of each a pass, the second timed (the first pass is a warm-up), the passes
    going up and down the widths in turn: a machine whose speed drifts while they are timed (a shared host's) moves
    every width alike, so their ratios, which the decisions read, hold (timed one width after another, a slow spell
    during the first width's runs once made 2 and 4 rows look cheaper than 1), while each width still follows
    itself or a neighbour, as a forward mostly follows one of its size in decoding (a one-row forward right after
    a 32-row one runs slower even a run later: going up every pass, 1 row timed a fifth dearer and 4 rows hardly
    dearer than 1). A wider forward is never taken as cheaper than a narrower one: what noise is left goes that way."""
    tokens = _tokens(context, widths)
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):
        for w in sorted(widths, reverse=rep % 2 == 1):
            for timed in (False, True):
                t = time.perf_counter()
                forward(tokens[:w])
                if rep and timed:
                    samples[w].append(time.perf_counter() - t)
                rollback()
    return _rising(samples)


def time_once(forward, rollback, context: list[int], widths=WIDTHS, known=None) -> dict[int, float]:
    """`time_widths` at its cheapest: up the widths, `QUICK_RUNS` runs of each in a row (an untimed one, then the
    faster of two timed: a hiccup of the machine, a few milliseconds taken by another process, rarely falls on
    both), and no wider once the forward has turned linear in its rows (`linear`): past that point a wider forward
    costs what the last rows' slope says (a compute-bound CPU, where 16 and 32 rows would take most of the
    measurement's time), so the wider widths are extended along it. A wider forward is never taken as cheaper than
    a narrower one. `known`: seconds per width timed already (a prefill's forwards, `costs.prefill`), not run
    again."""
    tokens = _tokens(context, widths)
    samples: dict[int, list[float]] = {w: list(known[w]) for w in widths if known and known.get(w)}
    for w in sorted(widths):
        if done(samples, widths):
            break
        if w in samples:
            continue
        samples[w] = []
        for run in range(QUICK_RUNS):
            t = time.perf_counter()
            forward(tokens[:w])
            if run:
                samples[w].append(time.perf_counter() - t)
            rollback()
    return finished(samples, widths)


def done(samples: dict[int, list[float]], widths) -> bool:
    """Whether `samples` (seconds per width, ascending from 1) price every one of `widths`: each is timed, or the
    widest two timed have turned linear (`linear`) and the rest extend along them."""
    times = _rising({w: s for w, s in samples.items() if s})
    contiguous = sorted(times) == sorted(widths)[: len(times)]
    return contiguous and (len(times) == len(widths) or linear(times))


def finished(samples: dict[int, list[float]], widths) -> dict[int, float]:
    """The table `samples` give: the fastest per width, rising, wider widths extended along a linear end."""
    times = _rising({w: s for w, s in samples.items() if s})
    return extended(times, widths) if linear(times) else times


LINEAR = 0.9  # a forward of twice the rows costing this share of twice the time or more has turned linear


def linear(times: dict[int, float]) -> bool:
    """Whether the widest two widths measured (at least 4 rows) cost in proportion to their rows, nearly."""
    ws = sorted(times)
    if len(ws) < 2 or ws[-1] < 4:
        return False
    (a, b) = ws[-2:]
    return times[b] / times[a] >= LINEAR * b / a


def extended(times: dict[int, float], widths) -> dict[int, float]:
    """`times` with every wider width of `widths` added along the slope of its widest two."""
    a, b = sorted(times)[-2:]
    slope = (times[b] - times[a]) / (b - a)
    return {**times, **{w: times[b] + (w - b) * slope for w in widths if w > b}}
