"""Measured forward costs: how long one forward of w new tokens takes on the path in use.

The cost curve t(w) is what every draft-length and tree-size decision trades against: on a GPU, or
on the static CPU path, verifying several tokens costs little more than one, while on the eager CPU
path it grows much faster (docs/backends.md has the measured curves). One module per job:

- `timing`: `forward_times` times one forward per width on a fork of a runner (`time_widths`: the fastest of
  `reps` runs, the widths timed in turns so a drifting machine moves them alike; `time_once`: three runs a width,
  two timed, up to where the cost turns linear in the rows, wider widths extended along it);
- `tables`: a `Table` (width -> seconds, with the marginal times the drafters read kept), a `Curve` (a table
  after a context and its growth per token of context: `at_context` gives the table a decision reads, so long
  prompts get smaller drafts), `forward_time` and `marginal_time(s)` read them, `rows_within` the most rows a
  time budget allows;
- `interpolate`: reading a table between its widths (linear, extended linearly beyond);
- `slope`: the growth with context fitted from two tables measured apart (`context_slope`);
- `curves`: `curve(runner)`, once per engine (`Shared`: two engines keep their own), read from disk or measured:
  on a model this machine has not seen, timed in the first prefill's parts where rows are alone (`prefill`: the
  curve waits, `Curve.waiting`, until a prefill settles it), else within a fixed budget of forwards
  (`quick_curve`), so a first request costs a few forwards more than a later one, not a measurement; in full
  (`measure_curve`, with the growth with context) where `Shared.full_curves` asks, as a server's start and the
  bench do; `kept_curve` only reads what an engine holds, never a waiting curve (never measures: a batch sizing
  its prompt parts mid-step);
- `disk`: one JSON file per key under `cache_folder()`, written atomically; a file that does not read in full as
  a curve of its key is ignored, never trusted;
- `fingerprint`: the key, naming what a forward's time depends on: the machine (CPU model and flags, from
  `draftverify.machine`; the GPU's name; torch's thread count), the model's identity, its arithmetic (the engine's
  and the weights' dtype), the kernel build and torch's version, the path (backend, draft rounding) and the
  widths. A change in any part is another file, measured afresh;
- `busy`: a curve measured while other work took more than `BUSY_SHARE` of the CPU time its threads could have had
  (other processes, or a hypervisor's steal; read from /proc/stat) steers its own process only and is not written.

A curve only steers draft lengths, never what is accepted, so a stale, quick or foreign curve could cost speed
but never exactness.
"""

from draftverify.costs.busy import BUSY_SHARE, cpu_times, others_share
from draftverify.costs.curves import (
    FAR_CONTEXT,
    POLICY_CONTEXT,
    QUICK_CONTEXT,
    curve,
    kept_curve,
    measure_and_keep,
    measure_curve,
    quick_curve,
    quick_forwards,
)
from draftverify.costs.disk import cache_folder, load_curve, save_curve
from draftverify.costs.fingerprint import curve_key, kernel_build, machine
from draftverify.costs.slope import context_slope
from draftverify.costs.tables import (
    CONTEXT_STEP,
    KEPT_TABLES,
    Curve,
    Table,
    at_context,
    forward_time,
    marginal_time,
    marginal_times,
    rows_within,
)
from draftverify.costs.timing import TIMING, WIDTHS, forward_times, sync_device, time_once, time_widths

__all__ = [
    "BUSY_SHARE",
    "CONTEXT_STEP",
    "FAR_CONTEXT",
    "KEPT_TABLES",
    "POLICY_CONTEXT",
    "QUICK_CONTEXT",
    "TIMING",
    "WIDTHS",
    "Curve",
    "Table",
    "at_context",
    "cache_folder",
    "context_slope",
    "cpu_times",
    "curve",
    "curve_key",
    "forward_time",
    "forward_times",
    "kept_curve",
    "kernel_build",
    "load_curve",
    "machine",
    "marginal_time",
    "marginal_times",
    "measure_and_keep",
    "measure_curve",
    "others_share",
    "quick_curve",
    "quick_forwards",
    "rows_within",
    "save_curve",
    "sync_device",
    "time_once",
    "time_widths",
]
