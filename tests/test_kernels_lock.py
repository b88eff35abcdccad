"""The kernels' build folder: a lock left by a killed build must not make every later process wait forever, and a
finished build is imported as it stands (no builder run) when its record says it is this build."""

import os
import time
from pathlib import Path

import pytest

from draftverify import kernels


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build in progress keeps its lock
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert "stale kernel build lock" in capsys.readouterr().err


def test_a_build_is_imported_directly_only_when_its_record_matches(tmp_path):
    name = "draftverify_cpu_test"
    (tmp_path / f"{name}.so").write_bytes(b"not a shared library")  # importing this would raise
    record = kernels._build_record(kernels._flags(wide=False, vnni=False))
    assert kernels._load_built(tmp_path, name, record) is None  # no record: torch's builder decides
    (tmp_path / kernels.BUILT_FILE).write_text(kernels._build_record(kernels._flags(wide=True, vnni=True)))
    assert kernels._load_built(tmp_path, name, record) is None  # built with other flags: not this build


def test_a_finished_build_records_itself_and_loads_without_the_builder(monkeypatch):
    module = kernels.cpu()
    if module is None:
        pytest.skip(f"no compiled kernels here: {kernels.unavailable()}")
    folder = Path(module.__file__).parent
    flags = kernels.machine_flags()
    record = kernels._build_record(flags)
    assert (folder / kernels.BUILT_FILE).read_text() == record
    import torch.utils.cpp_extension as builder

    monkeypatch.setattr(builder, "load", lambda **_: pytest.fail("the builder ran for a recorded build"))
    again = kernels.cpu.__wrapped__()  # what a fresh process does
    assert again is not None and hasattr(again, "block_linear")
