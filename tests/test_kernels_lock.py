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
    again = kernels._cpu.__wrapped__()  # what a fresh process does
    assert again is not None and hasattr(again, "block_linear")


ZEN5 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "sse4_2"}


@pytest.mark.parametrize(
    "level, isa, kept",
    [
        ("", "avx512vnni", ZEN5),
        ("native", "avx512vnni", ZEN5),
        ("avx512vnni", "avx512vnni", ZEN5),
        ("avx512", "avx512", {"avx2", "fma", "avx512f", "avx512bw", "sse4_2"}),
        ("AVXVNNI", "avx2_avxvnni", {"avx2", "fma", "avx_vnni", "sse4_2"}),
        ("avx2", "avx2", {"avx2", "fma", "sse4_2"}),
    ],
)
def test_draftverify_isa_runs_a_lower_level_of_the_cpu(monkeypatch, level, isa, kept):
    """DRAFTVERIFY_ISA leaves out the flags above its level, so every choice (the build's name and flags, the q8
    default's VNNI test) sees the CPU it names; the build's name says which it is."""
    monkeypatch.setattr(kernels, "native_flags", lambda: set(ZEN5))
    monkeypatch.setenv("DRAFTVERIFY_ISA", level)
    kernels.cpu_flags.cache_clear()
    try:
        assert kernels.cpu_flags() == kept
        assert kernels.isa() == isa
        assert kernels.has_vnni() == (isa == "avx512vnni")
        assert ("-mavx512f" in kernels.machine_flags()) == isa.startswith("avx512")
    finally:
        kernels.cpu_flags.cache_clear()


@pytest.mark.parametrize(
    "level, message",
    [
        ("sse", "'sse' is not a level: use one of avx2, avxvnni, avx512, avx512vnni"),
        ("avx512", "needs avx512bw, avx512f"),
    ],
)
def test_draftverify_isa_refuses_what_the_cpu_lacks_in_one_line(monkeypatch, level, message):
    from draftverify.errors import DraftVerifyError

    monkeypatch.setattr(kernels, "native_flags", lambda: {"avx2", "fma"})  # Zen 3: no AVX-512
    monkeypatch.setenv("DRAFTVERIFY_ISA", level)
    kernels.cpu_flags.cache_clear()
    try:
        with pytest.raises(DraftVerifyError, match=message):
            kernels.cpu_flags()
    finally:
        kernels.cpu_flags.cache_clear()
