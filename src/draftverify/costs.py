"""Measured forward costs: how long one forward of w new tokens takes on the path in use.

The cost curve t(w) is what every draft-length and tree-size decision trades against: on a GPU, or
on the static CPU path, verifying several tokens costs little more than one, while on the eager CPU
path it grows much faster (docs/backends.md has the measured curves). `forward_times` measures it
(fastest of `reps` runs per width after a fixed context, the widths timed in turns so a drifting machine moves
them alike); `curve(runner)` measures it once per model,
path and width set and keeps it in the runner's `Shared` (its engine's, so two engines keep their own);
`forward_time` reads a table between the widths.

The curve also grows with the context: every new token's attention reads every cached one, so a
wide forward after a long context costs more than after a short one (and one token hardly more). A
`Curve` holds the widths' times after a short context and how they grow per token of context
(measured a second time after `FAR_CONTEXT` tokens); `at_context` gives the table for the context a
decision is made at, so long prompts get smaller drafts.

Measuring a curve takes seconds, paid by the first request of a process. An engine therefore keeps its
curves on disk as well (`Shared.curve_folder`, `cache_folder()` under the cache root): one JSON file per
key, the key naming what a forward's time depends on: the machine (CPU model and flags, the GPU's name,
torch's thread count), the model's identity, its arithmetic (dtype), the kernel build and torch's version,
the path (backend, draft rounding) and the widths. A file whose key matches in full is read instead of
measuring; a change in any part is another file, measured afresh. A curve measured while other work took more
than `BUSY_SHARE` of the CPU time its threads could have had (other processes, or a hypervisor's steal) steers its
own process only and is not written: a busy moment does not steer later processes. A curve only steers draft
lengths, never what is accepted, so a stale or foreign curve could cost speed but never exactness.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from draftverify.models import Runner
from draftverify.util import atomic_write, cache_root

WIDTHS = (1, 2, 4, 8, 16, 32)
TIMING = 4  # how `time_widths` times (in the curves' key: a file measured the old way, widths in turn, is not read)
POLICY_CONTEXT = 64  # tokens of context before the policy's timed forwards
FAR_CONTEXT = 1024  # and before the second measurement, for the growth with context
# A curve is read at the context rounded down to a multiple of this: a few tokens of context barely move a forward's
# time, and one table (with the marginal times drawn from it) then serves several rounds.
CONTEXT_STEP = 16
KEPT_TABLES = 256  # a curve's tables at this many contexts at most (then it starts over)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_times(
    runner: Runner, context: list[int], widths=WIDTHS, reps: int = 5, all_logits: bool = True
) -> dict[int, float]:
    """Seconds of one forward of w new tokens after `context`, for each w in `widths`, on a fork of `runner` (its
    model on its path: a drafting runner's forward is timed as it drafts): the fastest of `reps` runs (the least
    disturbed by the rest of the machine).

    `all_logits`: compute logits for every new token (the target verifying drafts) or only
    the last one (the draft proposing).
    """
    runner = runner.fork()
    runner.forward(context, last=1)
    base = runner.length

    def forward(tokens: list[int]) -> None:
        runner.forward(tokens, last=None if all_logits else 1)
        sync_device(runner.device)

    return time_widths(forward, lambda: runner.crop(base), context, widths, reps)


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
    tokens = (context * (max(widths) // max(1, len(context)) + 1))[: max(widths)]
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):
        for w in sorted(widths, reverse=rep % 2 == 1):
            for timed in (False, True):
                t = time.perf_counter()
                forward(tokens[:w])
                if rep and timed:
                    samples[w].append(time.perf_counter() - t)
                rollback()
    times, floor = {}, 0.0
    for w in sorted(widths):
        times[w] = floor = max(floor, min(samples[w]))
    return times


class Table(dict):
    """A cost table (width -> seconds) that keeps its points in ascending order for `forward_time`, and the
    `marginal_time`s and `marginal_times` asked of it: the drafters read one several times a round. Built once,
    never changed."""

    def __init__(self, times: dict[int, float]):
        super().__init__(times)
        self.points = _points(times)
        self.marginals: dict[tuple[int, int], list[float]] = {}  # (upto, others) -> marginal_times
        self.marginal: dict[tuple[int, int], float] = {}  # (width, others) -> marginal_time


class Curve(Table):
    """t(w) in seconds after `context` tokens (the table itself: width -> seconds, as `forward_times` gives),
    plus `slope[w]`: the seconds each further token of context adds to it."""

    def __init__(self, times: dict[int, float], context: int, slope: dict[int, float] | None = None):
        super().__init__(times)
        self.context, self.slope = context, slope or {}
        # the tables `at` made, by context: a round asks for its context more than once, and the requests of a batch
        # (which share the curve) each for its own
        self.tables: dict[int, Table] = {}

    def at(self, context: int) -> Table:
        """The table after `context` tokens, read per `CONTEXT_STEP` tokens (one table serves a few rounds)."""
        context -= context % CONTEXT_STEP
        table = self.tables.get(context)
        if table is None:
            if len(self.tables) >= KEPT_TABLES:
                self.tables.clear()
            more = max(0, context - self.context)
            table = self.tables[context] = Table({w: t + more * self.slope.get(w, 0.0) for w, t in self.items()})
        return table


def at_context(costs: dict, context: int) -> dict[int, float]:
    """The cost table for a forward after `context` tokens (a plain table has no context: as it is)."""
    return costs.at(context) if isinstance(costs, Curve) else costs


def context_slope(near: dict[int, float], far: dict[int, float], span: int) -> dict[int, float]:
    """Per width, the seconds per token of context from two tables measured `span` tokens apart: the
    per-width growth fitted as a + b w with a, b >= 0 (one line through noisy differences; attention's
    cost is a fixed part per forward plus a part per new token)."""
    widths = sorted(near)
    growth = [(far[w] - near[w]) / span for w in widths]
    mean_w, mean_g = sum(widths) / len(widths), sum(growth) / len(growth)
    spread = sum((w - mean_w) ** 2 for w in widths)
    b = max(0.0, sum((w - mean_w) * (g - mean_g) for w, g in zip(widths, growth)) / spread) if spread else 0.0
    a = max(0.0, mean_g - b * mean_w)
    return {w: a + b * w for w in widths}


def curve(runner: Runner, all_logits: bool = True, widths=(1, 2, 4, 8, 16)) -> Curve:
    """The cost curve of `runner`'s model on its backend, measured once per engine (`runner.shared`; 3 runs a
    width), after `POLICY_CONTEXT` tokens and again after `FAR_CONTEXT` (or as many as the model's positions
    allow); read from `runner.shared.curve_folder` instead when a file there has this curve's key."""
    key = (runner.backend, runner.draft, all_logits, tuple(widths))
    found = runner.shared.curves.setdefault(runner.model, {})
    if key not in found:
        folder = getattr(runner.shared, "curve_folder", None)
        disk_key = curve_key(runner, all_logits, widths) if folder is not None else None
        if folder is None:
            found[key] = measure_curve(runner, all_logits, widths)
        else:
            found[key] = load_curve(folder, disk_key) or measure_and_keep(runner, all_logits, widths, folder, disk_key)
    return found[key]


def measure_and_keep(runner: Runner, all_logits: bool, widths, folder: Path, key: dict) -> Curve:
    """`measure_curve`, written under `key` in `folder` unless other work took more than `BUSY_SHARE` of the CPU
    time meanwhile (then it steers this process only, and one line on stderr says so)."""
    before = cpu_times()
    measured = measure_curve(runner, all_logits, widths)
    busy = others_share(before, cpu_times())
    if busy is None or busy <= BUSY_SHARE:
        save_curve(folder, key, measured)
    else:
        print(
            f"draftverify: other work used {busy:.0%} of the CPU time while the cost curve was measured: it "
            "steers this process only, and a later one measures again (see docs/serve.md, the first request)",
            file=sys.stderr,
            flush=True,
        )
    return measured


def measure_curve(runner: Runner, all_logits: bool, widths) -> Curve:
    """Time `runner`'s forwards for `curve`: after `POLICY_CONTEXT` tokens, and after `FAR_CONTEXT` for the slope."""
    from draftverify.loading.hf import vocab_rows

    vocab = vocab_rows(runner.model)
    limit = getattr(runner.model.config, "max_position_embeddings", None) or FAR_CONTEXT + max(widths)
    far = min(FAR_CONTEXT, limit - max(widths))

    def times(n: int) -> dict[int, float]:
        context = [(7 * i + 3) % vocab for i in range(n)]
        return forward_times(runner, context, widths, reps=3, all_logits=all_logits)

    near = times(POLICY_CONTEXT)
    slope = context_slope(near, times(far), far - POLICY_CONTEXT) if far >= 4 * POLICY_CONTEXT else None
    return Curve(near, POLICY_CONTEXT, slope)


# -- curves on disk ------------------------------------------------------------------------------

# A curve is kept on disk only if other work (other processes, and time the hypervisor gave these CPUs to other
# machines: "steal") took at most this share of the CPU time the forwards' threads needed while it was measured: a
# curve measured beside a build or a test run misreads what the wide forwards cost against a one-token one, and
# would steer every later process on this machine.
BUSY_SHARE = 0.15


def cpu_times() -> tuple[int, int, float, int] | None:
    """For the CPUs this process may run on: (their busy and stolen time since boot, in clock ticks; all their time,
    busy or idle; this process's own CPU seconds; how many CPUs), or None where the kernel does not say (no
    /proc/stat)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except (OSError, AttributeError):
        return None
    rows = [fields for fields in map(str.split, lines) if fields and fields[0] in mine]
    if not rows:
        return None
    busy = total = 0
    for fields in rows:
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
    own = os.times()
    return busy, total, own.user + own.system, len(rows)


def others_share(before, after, threads: int | None = None) -> float | None:
    """How much of the CPU time this process's `threads` (torch's) could have had between two `cpu_times` went to
    other work instead: other work's time beyond what the CPUs those threads leave free could absorb, over the
    threads' time. None when either reading is unknown or no tick passed."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    cpus = after[3]
    threads = min(cpus, threads or torch.get_num_threads())
    hz = os.sysconf("SC_CLK_TCK")
    elapsed = (after[1] - before[1]) / cpus  # ticks per CPU
    others = (after[0] - before[0]) - (after[2] - before[2]) * hz
    return max(0.0, others - (cpus - threads) * elapsed) / (threads * elapsed)


def cache_folder() -> Path:
    """Where engines keep their measured curves: `<cache root>/curves`."""
    return cache_root() / "curves"


@functools.cache
def machine() -> dict:
    """What a forward's time depends on in the machine: the CPU's model name and flags (hashed: a long list)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    info: dict[str, str] = {}
    for line in lines:  # the first core's lines: every core of a machine reports the same model and flags
        name, _, value = line.partition(":")
        info.setdefault(name.strip(), value.strip())
    flags = " ".join(sorted(info.get("flags", "").split()))
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": hashlib.sha1(flags.encode()).hexdigest()[:12],
    }


@functools.cache
def kernel_build() -> str:
    """The kernels' build tag (a hash of their sources and the instruction set they are built for) and torch's
    version: a rebuild can change any time."""
    from draftverify.kernels import isa, source_tag

    return f"{source_tag()}-{isa()}-torch{torch.__version__}"


def curve_key(runner: Runner, all_logits: bool, widths) -> dict:
    """Everything a curve's measured times depend on (see the module's docstring), as JSON values."""
    from draftverify.loading.hf import model_identity

    device = runner.device
    return {
        **machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "model": model_identity(runner.model),
        # the engine's arithmetic (q8 or fp32: the same weights' forwards cost differently) and the weights' dtype
        "arithmetic": f"{runner.shared.packs.arithmetic} {runner.dtype}",
        "timing": TIMING,
        "kernels": kernel_build(),
        "backend": runner.backend,
        "draft": runner.draft,
        "all_logits": all_logits,
        "widths": list(widths),
    }


def _curve_file(folder: Path, key: dict) -> Path:
    return Path(folder) / f"{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"


def load_curve(folder: Path, key: dict) -> Curve | None:
    """The curve saved under `key` in `folder`, or None when there is none (or it is unreadable, or its key
    differs: a hash collision is then re-measured, never trusted)."""
    try:
        data = json.loads(_curve_file(folder, key).read_text())
        if data["key"] != json.loads(json.dumps(key)):
            return None
        times = {int(w): float(t) for w, t in data["times"].items()}
        slope = {int(w): float(t) for w, t in data["slope"].items()} if data.get("slope") else None
        return Curve(times, int(data["context"]), slope)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_curve(folder: Path, key: dict, measured: Curve) -> None:
    """Write `measured` under `key` (atomically: a reader sees the old file or the new one). A folder that cannot
    be written costs the next process a measurement, nothing else."""
    path = _curve_file(folder, key)
    if path.exists():
        return
    data = {"key": key, "times": dict(measured), "context": measured.context, "slope": measured.slope or None}
    try:
        atomic_write(path, json.dumps(data, indent=1) + "\n")
    except OSError:
        pass


def forward_time(table: dict[int, float], width: int) -> float:
    """t(width) from a table of measured widths: linear between points, extended linearly beyond."""
    return _between(_points(table), width)


def _between(points: list[tuple[int, float]], width: int) -> float:
    """`forward_time` on the table's (width, seconds) points in ascending order."""
    if len(points) == 1:
        return points[0][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if width <= w1 or (w1, t1) == points[-1]:
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
    raise AssertionError("unreachable")


def marginal_time(table: dict[int, float], width: int, others: int = 0) -> float:
    """Seconds `width` rows add to a forward that carries `others` rows of other sequences (a batch); alone
    (others = 0) that is t(width). Never below a twentieth of t(1) per row: a measured curve can dip."""
    if not isinstance(table, Table):
        return _marginal(_points(table), width, others)
    found = table.marginal.get((width, others))
    if found is None:
        found = table.marginal[width, others] = _marginal(table.points, width, others)
    return found


def marginal_times(table: dict[int, float], upto: int, others: int = 0) -> list[float]:
    """[marginal_time(table, w, others) for w in 1..upto] (a tree's sizes, each round; a `Table` keeps them:
    do not change the list)."""
    found = table.marginals.get((upto, others)) if isinstance(table, Table) else None
    if found is None:
        points = _points(table)
        found = [_marginal(points, w, others) for w in range(1, upto + 1)]
        if isinstance(table, Table):
            table.marginals[(upto, others)] = found
    return found


def _points(table: dict[int, float]) -> list[tuple[int, float]]:
    return table.points if isinstance(table, Table) else sorted((int(w), t) for w, t in table.items())


def _marginal(points: list[tuple[int, float]], width: int, others: int) -> float:
    if others <= 0:
        return _between(points, width)
    return max(_between(points, others + width) - _between(points, others), 0.05 * width * _between(points, 1))
