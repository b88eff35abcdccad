"""A cost curve measured inside a prompt's prefill: `forward(runner, feed)` runs a request's first forward.

A model this machine has not seen has no curve on disk, and a request that drafts needs one to price its drafts.
Measuring it apart costs forwards a request does not need (a short prefill and a few forwards of each width). But a
prompt's rows are work the request needs anyway, and where a forward's rows do not depend on the rows beside them
(`Runner.rows_alone`: the bits of a row are the same in a forward of one row or of many) the prompt can be fed in
parts with the same result, bit for bit, as the prefix cache already feeds it. So where a curve of the runner's
path waits to be measured (`curves.waiting_curves`), the prefill goes as:

- the prompt's first rows, untimed: all but those the timed parts take, at least one (a process's first forward
  pays for whatever is still cold, pages of the weights and code paths, so it is never a timed one);
- then one part of each width the waiting curves name, 1, 2, 4, ... rows (as many widths as the prompt has rows
  for), each timed with logits for every row as a verifying forward computes them (a draft model's curve: for the
  last row, as it proposes), until the cost has turned linear in the rows (`timing.done`); the rows left for wider
  parts then go in one forward.

The target's curves are timed in the request's prefill (`round.drive`), a draft model's in the draft's own prefill
of the prompt (`drafters.draft_model.DraftModel.start`, only while one waits: otherwise the draft takes the prompt
with its first proposal, as it always has).

The seconds go to each waiting curve (`Curve.settle`): where they price all its widths nothing more runs, else the
widths the prompt was too short for are timed as a quick curve times them (`curves.quick_curve`). The parts cost
more than one forward of the same rows (each part reads every weight once): a few one-row steps, where the
measurement apart cost those forwards and more, on top of the prompt's. One timed run a width, where the
measurement apart took the faster of two: a hiccup steers this process's drafts, never what is accepted.
"""

from __future__ import annotations

import time

import torch

from draftverify.backend.feed import Feed, Forward
from draftverify.costs import busy, timing
from draftverify.costs.curves import waiting_curves
from draftverify.models import Runner


def forward(runner: Runner, feed: Feed, all_logits: bool = True) -> Forward:
    """`runner.run(feed)`; for a plain prefill (causal, new positions, the last rows' logits) where a curve of
    `runner`'s path waits to be measured, the same forward in timed parts, the waiting curves measured from them.
    `all_logits`: the curves of a target's verifying forwards (each part's logits for every row), else of a draft's
    proposing ones (the last row's)."""
    waiting = waiting_curves(runner, all_logits)
    if not waiting or not _plain(feed):
        return runner.run(feed)
    widths = sorted({w for key in waiting for w in key[3]})
    tokens = torch.as_tensor(feed.tokens).view(-1)
    timed = _timed_widths(widths, len(tokens) - 1)
    since = busy.cpu_times()
    samples: dict[int, list[float]] = {}
    head = len(tokens) - sum(timed)  # at least one row, untimed: what is cold is paid there
    outs, at = [runner.run(_part(feed, tokens[:head], final=not timed))], head
    for w in timed:
        if timing.done(samples, widths):
            outs.append(runner.run(_part(feed, tokens[at:], final=True)))
            break
        start = time.perf_counter()
        outs.append(runner.run(Feed(tokens[at : at + w], last=None if all_logits else 1, hidden=feed.hidden)))
        timing.sync_device(runner.device)
        samples[w] = [time.perf_counter() - start]
        at += w
    for key, pending in waiting.items():
        pending.settle({w: s for w, s in samples.items() if w in key[3]}, since)
    return _joined(feed, outs)


def _timed_widths(widths: list[int], rows: int) -> list[int]:
    """The widths, ascending, whose parts fit in `rows` rows together."""
    timed: list[int] = []
    for w in widths:
        if sum(timed) + w > rows:
            break
        timed.append(w)
    return timed


def _plain(feed: Feed) -> bool:
    """Whether `feed` is a prompt's prefill: causal at the next positions, logits for its last row (and the hidden
    states of its last row or of all), drafting nothing."""
    plain = feed.positions is None and feed.tree_mask is None and feed.skip is None and feed.vocab is None
    return plain and feed.last == 1 and feed.hidden in (False, True, "all") and len(feed.tokens) > 1


def _part(feed: Feed, tokens: torch.Tensor, final: bool) -> Feed:
    """The feed of an untimed part: the last row's logits (the final part's are the prefill's)."""
    return Feed(tokens, last=1, hidden=feed.hidden if final or feed.hidden == "all" else False)


def _joined(feed: Feed, outs: list[Forward]) -> Forward:
    """The parts' outputs as the one forward of `feed` would give them: the last row's logits (and hidden state),
    every row's hidden states for "all"."""
    last = outs[-1]
    hidden = None
    if feed.hidden == "all":
        hidden = torch.cat([out.hidden for out in outs])
    elif feed.hidden:
        hidden = last.hidden[-1:]
    return Forward(last.logits[-1:], hidden)
