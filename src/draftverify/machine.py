"""The machine's facts, read once a process: the CPU's model name, flags, cache size and the cores this process may
run on. /proc/cpuinfo is parsed here only; the kernels (`kernels.native_flags`), the cost curves' key
(`costs.fingerprint.machine`) and the bench's environment record (`bench.measure.environment`) read it from here.

Where there is no /proc/cpuinfo (not Linux) the facts are empty and the model name falls back to what `platform`
says, so every caller still runs, without the kernels that need flags it cannot see.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first core's fields of /proc/cpuinfo (name -> value): every core of a machine reports the same model,
    flags and caches. Empty where the file cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        info.setdefault(name.strip(), value.strip())
    return info


def cpu_model() -> str:
    """The CPU's model name (what `platform` says where /proc/cpuinfo does not)."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def native_flags() -> set[str]:
    """The flags /proc/cpuinfo gives this CPU (empty where there is none)."""
    return set(cpuinfo().get("flags", "").split())


def cache_size() -> str | None:
    """The CPU's cache size as /proc/cpuinfo gives it (e.g. '512 KB'), or None."""
    return cpuinfo().get("cache size")


def cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
