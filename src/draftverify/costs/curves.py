"""`curve(runner)`: a model's cost curve on its path, from the engine's memory, else its file, else measured.

Two measurements, one bounded and one thorough:

- a quick curve (an engine's default). Where a model's rows do not depend on the rows beside them it waits for
  the next prefill on its path, which times its widths among the prompt's parts (`costs.prefill`); what the
  prompt leaves out, and every quick curve elsewhere, `quick_curve` measures apart:
  one prefill of `QUICK_CONTEXT` tokens, then three forwards of each width
  up to the one where the forward's cost has turned linear in its rows, wider ones extended along that slope
  (`timing.time_once`): at most `quick_forwards(widths)` forwards in all, whatever the model, so the first request
  on a model this machine has not seen pays a few forwards of each width, not a measurement, and on a
  compute-bound CPU none of the widest, dearest ones. It has no growth with context (the same table at every
  context).
- `measure_curve` (`Shared.full_curves`: a server's start, the bench): the fastest of 3 runs a width after
  `POLICY_CONTEXT` tokens and again after `FAR_CONTEXT`, for the growth with context (`slope.context_slope`).

A file holding a quick curve serves an engine that wants one; an engine that wants the full curve measures it and
replaces the file; a full curve is never replaced by a quick one.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from draftverify.costs import busy, disk, fingerprint, timing
from draftverify.costs.slope import context_slope
from draftverify.costs.tables import Curve
from draftverify.models import Runner

POLICY_CONTEXT = 64  # tokens of context before the policy's timed forwards
FAR_CONTEXT = 1024  # and before the second measurement, for the growth with context
QUICK_CONTEXT = 16  # tokens of context before a quick curve's forwards: one short prefill


def quick_forwards(widths) -> int:
    """The most forwards `quick_curve` runs for `widths`: the prefill, then `timing.QUICK_RUNS` of each width."""
    return 1 + timing.QUICK_RUNS * len(widths)


def curve(runner: Runner, all_logits: bool = True, widths=(1, 2, 4, 8, 16)) -> Curve:
    """The cost curve of `runner`'s model on its path, obtained once per engine (`runner.shared`): read from
    `runner.shared.curve_folder` when a file there has this curve's key (and is full, where the engine wants full
    curves), else measured (`quick_curve`, or `measure_curve` with `Shared.full_curves`) and written there. A
    quick curve of a model whose rows do not depend on the rows beside them waits, unmeasured, for the next
    prefill on its path to time its widths among the prompt's own forwards (`Curve.waiting`, `costs.prefill`: the
    target's in the request's prefill, a draft model's in its own)."""
    full = runner.shared.full_curves
    key = (runner.backend, runner.draft, all_logits, tuple(widths))
    found = runner.shared.curves.setdefault(runner.model, {})
    kept = found.get(key)
    if kept is None or (full and kept.quick):
        found[key] = _obtain(runner, all_logits, widths, full)
    return found[key]


def kept_curve(runner: Runner, all_logits: bool = True) -> Curve | None:
    """The curve of `runner`'s model on its path that its engine already holds, of the widest widths (None: none
    yet). Never measures: for a caller that must not stop for a measurement (`batch.Batch` sizing a prompt part)."""
    found = runner.shared.curves.get(runner.model, {})
    kept = [
        (max(key[3]), c)
        for key, c in found.items()
        if key[:3] == (runner.backend, runner.draft, all_logits) and c.pending is None
    ]
    return max(kept, key=lambda k: k[0])[1] if kept else None


def waiting_curves(runner: Runner, all_logits: bool = True) -> dict[tuple, Curve]:
    """The curves of `runner`'s model on its path that wait to be measured (by key): of forwards with every row's
    logits (a target verifying), or with the last row's only (a draft proposing)."""
    found = runner.shared.curves.get(runner.model, {})
    path = (runner.backend, runner.draft, all_logits)
    return {key: c for key, c in found.items() if key[:3] == path and c.pending is not None}


def _obtain(runner: Runner, all_logits: bool, widths, full: bool) -> Curve:
    """The curve from its file, or measured (and written), or waiting for a prefill to measure it."""
    measure = measure_curve if full else quick_curve
    folder, key = runner.shared.curve_folder, None
    if folder is not None:
        key = fingerprint.curve_key(runner, all_logits, widths)
        kept = disk.load_curve(folder, key)
        if kept is not None and not (full and kept.quick):
            return kept
    if not full and runner.rows_alone:  # a prompt's rows can be fed in parts: time them there

        def measured(known: dict[int, list[float]], since=None) -> Curve:
            quick = functools.partial(quick_curve, known=known)
            if folder is None:
                return quick(runner, all_logits, widths)
            return measure_and_keep(runner, all_logits, widths, folder, key, quick, since)

        return Curve.waiting(measured)
    if folder is None:
        return measure(runner, all_logits, widths)
    return measure_and_keep(runner, all_logits, widths, folder, key, measure)


def measure_and_keep(
    runner: Runner, all_logits: bool, widths, folder: Path, key: dict, measure=None, since=None
) -> Curve:
    """`measure` (`measure_curve` unless given), written under `key` in `folder` unless other work took more than
    `busy.BUSY_SHARE` of the CPU time meanwhile (then it steers this process only, and one line on stderr says so).
    `since`: the `busy.cpu_times()` when the measurement began, where part of it ran before (a prefill's)."""
    before = since or busy.cpu_times()
    measured = (measure or measure_curve)(runner, all_logits, widths)
    share = busy.others_share(before, busy.cpu_times())
    if share is None or share <= busy.BUSY_SHARE:
        disk.save_curve(folder, key, measured)
    else:
        print(
            f"draftverify: other work used {share:.0%} of the CPU time while the cost curve was measured: it "
            "steers this process only, and a later one measures again (see docs/serve.md, the first request)",
            file=sys.stderr,
            flush=True,
        )
    return measured


def _context(runner: Runner, n: int) -> list[int]:
    """`n` tokens of a fixed made-up context in the model's vocabulary."""
    from draftverify.loading.hf import vocab_rows

    vocab = vocab_rows(runner.model)
    return [(7 * i + 3) % vocab for i in range(n)]


def quick_curve(runner: Runner, all_logits: bool, widths, known: dict[int, list[float]] | None = None) -> Curve:
    """Time `runner`'s forwards for `curve` within a fixed budget (`quick_forwards`): two timed runs a width after
    `QUICK_CONTEXT` tokens (the faster of two), up to where the cost turns linear (`timing.time_once`), no growth
    with context. `known`: seconds per width a prefill timed already (`costs.prefill`): where they price every
    width, nothing is run."""
    if known and timing.done(known, widths):
        return Curve(timing.finished({w: known[w] for w in widths if w in known}, widths), QUICK_CONTEXT, quick=True)
    limit = getattr(runner.model.config, "max_position_embeddings", None) or QUICK_CONTEXT + max(widths)
    n = max(1, min(QUICK_CONTEXT, limit - max(widths)))
    times = timing.forward_times(runner, _context(runner, n), widths, all_logits=all_logits, quick=True, known=known)
    return Curve(times, n, quick=True)


def measure_curve(runner: Runner, all_logits: bool, widths) -> Curve:
    """Time `runner`'s forwards for `curve`: after `POLICY_CONTEXT` tokens, and after `FAR_CONTEXT` for the slope
    (or as many as the model's positions allow)."""
    limit = getattr(runner.model.config, "max_position_embeddings", None) or FAR_CONTEXT + max(widths)
    far = min(FAR_CONTEXT, limit - max(widths))

    def times(n: int) -> dict[int, float]:
        return timing.forward_times(runner, _context(runner, n), widths, reps=3, all_logits=all_logits)

    near = times(POLICY_CONTEXT)
    slope = context_slope(near, times(far), far - POLICY_CONTEXT) if far >= 4 * POLICY_CONTEXT else None
    return Curve(near, POLICY_CONTEXT, slope)
