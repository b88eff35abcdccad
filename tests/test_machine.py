"""The machine's facts come from one reading of /proc/cpuinfo (draftverify.machine), which the kernels, the cost
curves' key and the bench's environment record share."""

from __future__ import annotations

import hashlib

import pytest

from draftverify import kernels, machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
cache size\t: 512 KB
flags\t\t: fpu avx2 fma sse4_2

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx2 fma sse4_2
"""


@pytest.fixture
def fake_cpuinfo(monkeypatch):
    reads = []

    class FakePath:
        def __init__(self, name):
            self.name = name

        def read_text(self):
            reads.append(self.name)
            return CPUINFO

    monkeypatch.setattr(machine, "Path", FakePath)
    machine.cpuinfo.cache_clear()
    yield reads
    machine.cpuinfo.cache_clear()


def test_cpuinfo_is_read_once_and_gives_the_first_cores_facts(fake_cpuinfo):
    assert machine.cpu_model() == "AMD EPYC 7B13"
    assert machine.native_flags() == {"fpu", "avx2", "fma", "sse4_2"}
    assert machine.cache_size() == "512 KB"
    assert machine.cpuinfo()["vendor_id"] == "AuthenticAMD"
    assert fake_cpuinfo == ["/proc/cpuinfo"]  # one reading for every fact
    assert machine.cores() >= 1


def test_the_kernels_and_the_curves_key_read_the_same_facts(fake_cpuinfo, monkeypatch):
    from draftverify.costs import fingerprint

    monkeypatch.delenv("DRAFTVERIFY_ISA", raising=False)
    kernels.cpu_flags.cache_clear()
    fingerprint.machine.cache_clear()
    try:
        assert kernels.cpu_flags() == machine.native_flags()
        flags = hashlib.sha1(b"avx2 fma fpu sse4_2").hexdigest()[:12]
        assert fingerprint.machine() == {"cpu": "AMD EPYC 7B13", "cpu_flags": flags}
    finally:
        kernels.cpu_flags.cache_clear()
        fingerprint.machine.cache_clear()


def test_no_cpuinfo_leaves_the_facts_empty(monkeypatch):
    class Missing:
        def __init__(self, name):
            pass

        def read_text(self):
            raise OSError("no such file")

    monkeypatch.setattr(machine, "Path", Missing)
    machine.cpuinfo.cache_clear()
    try:
        assert machine.cpuinfo() == {} and machine.native_flags() == set() and machine.cpu_model()
    finally:
        machine.cpuinfo.cache_clear()
