"""A kernel build lock left by a killed build must not make every later process wait forever."""

import os
import time

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
