"""Curves on disk: one JSON file per key (`fingerprint.curve_key`) under `cache_folder()`, written atomically.

A file is trusted only when it reads in full as a curve of its key: JSON with the very key asked for (a hash
collision's file is another key's), a positive, finite time for each of the key's widths and nothing else. Anything
short of that (a truncated or hand-edited file, another version's layout) is ignored, as if there were none, and
the next measurement replaces it. Two processes writing one file at once each write a temporary of their own and
rename it into place (`util.atomic_write`): the file is then one or the other, whole.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from draftverify.costs.tables import Curve
from draftverify.util import atomic_write, cache_root


def cache_folder() -> Path:
    """Where engines keep their measured curves: `<cache root>/curves`."""
    return cache_root() / "curves"


def curve_file(folder: Path, key: dict) -> Path:
    return Path(folder) / f"{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"


def _seconds(table, widths: set[int]) -> dict[int, float]:
    """A table of the file, checked: exactly `widths`, each a finite time >= 0 (ValueError otherwise)."""
    times = {int(w): float(t) for w, t in table.items()}
    if set(times) != widths or not all(math.isfinite(t) and t >= 0 for t in times.values()):
        raise ValueError("not a table of this key's widths")
    return times


def load_curve(folder: Path, key: dict) -> Curve | None:
    """The curve saved under `key` in `folder`, or None when there is none (or it is unreadable, incomplete, or its
    key differs: a hash collision is then re-measured, never trusted)."""
    try:
        data = json.loads(curve_file(folder, key).read_text())
        if data["key"] != json.loads(json.dumps(key)):
            return None
        widths = {int(w) for w in key["widths"]}
        times = _seconds(data["times"], widths)
        if not all(times.values()):
            return None  # a forward takes time: a zero is a damaged file
        slope = _seconds(data["slope"], widths) if data.get("slope") else None
        return Curve(times, int(data["context"]), slope, quick=bool(data.get("quick", False)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_curve(folder: Path, key: dict, measured: Curve) -> None:
    """Write `measured` under `key` (atomically: a reader sees the old file or the new one), unless the file holds
    a curve of this key already that is as good (a full measurement, or a quick one and `measured` is quick too).
    A folder that cannot be written costs the next process a measurement, nothing else."""
    kept = load_curve(folder, key)
    if kept is not None and (measured.quick or not kept.quick):
        return
    data = {
        "key": key,
        "times": dict(measured),
        "context": measured.context,
        "slope": measured.slope or None,
        "quick": measured.quick,
    }
    try:
        atomic_write(curve_file(folder, key), json.dumps(data, indent=1) + "\n")
    except OSError:
        pass
