"""Whether other work shared the CPUs while a curve was measured, read from /proc/stat.

A curve is kept on disk only if other work (other processes, and time the hypervisor gave these CPUs to other
machines: "steal") took at most `BUSY_SHARE` of the CPU time the forwards' threads needed while it was measured: a
curve measured beside a build or a test run misreads what the wide forwards cost against a one-token one, and
would steer every later process on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

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
