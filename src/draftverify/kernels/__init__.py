"""The static path's CPU kernels (csrc/, one file per operation and weight layout, as ggml's CPU backend is split:
products_fp32.cpp the one-row matmul, products_q4q8.cpp the exact Q4_1 / Q8_0 product, products_blocks.cpp the GGUF
block layouts of blocks.py, products_q8.cpp the q8 arithmetic's tiles (a target in q8, and drafts), attention.cpp
the attention of new tokens (up to 32 in a decoding step or a tree, 128 rows a call in a prefill), norms.cpp
RMSNorm, layer.cpp SiLU(gate) * up and a whole decoder layer in one call, draft_ops.cpp the feature head's ops;
module.cpp registers them all), compiled once per machine and cached.

`cpu()` returns the compiled module, or None with `unavailable()` saying why in one line
(not x86-64 with AVX2 + FMA, no C++ compiler or ninja, a failed build, or
`DRAFTVERIFY_KERNELS=0`); the static path then uses oneDNN for every row count, ATen's
RMSNorm and SDPA. The build
takes a few minutes on 2 cores, says so on stderr, and lands in `~/.cache/draftverify/kernels/`
under a name that changes with the source and the CPU's vector width (an AVX-512 build for a CPU
that has it, else AVX2), with a record of the torch and flags it was built with (`BUILT_FILE`), so later processes
import it directly, whatever path their checkout of the same sources sits at.

`DRAFTVERIFY_ISA` (`avx2`, `avxvnni`, `avx512`, `avx512vnni`) runs a lower level of this CPU's instruction set, as
though the CPU stopped there: the build, every choice of path and the reports follow (`cpu_flags` leaves out what
lies above it). So the AVX2 kernels (Zen 3's) are built and tested on an AVX-512 machine:
`DRAFTVERIFY_ISA=avx2 bash scripts/test.sh`. A level this CPU does not have is refused.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

from draftverify.machine import native_flags  # (here by name: a test stands in another CPU's flags)

CSRC = Path(__file__).with_name("csrc")
_why_not: str | None = None


def unavailable() -> str | None:
    """Why `cpu()` is None (None when it loaded or was not asked for yet)."""
    return _why_not


# DRAFTVERIFY_ISA's levels: the flags each one needs, and the flags of the levels above it that it leaves out
ISA_LEVELS = {
    "avx2": ({"avx2", "fma"}, {"avx_vnni"}),
    "avxvnni": ({"avx2", "fma", "avx_vnni"}, set()),
    "avx512": ({"avx2", "fma", "avx512f", "avx512bw"}, {"avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16"}),
    "avx512vnni": ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}, set()),
}


@functools.cache
def cpu_flags() -> set[str]:
    """This CPU's flags, less those above the level `DRAFTVERIFY_ISA` names, if set (read once a process)."""
    flags = native_flags()
    level = os.environ.get("DRAFTVERIFY_ISA", "").strip().lower()
    if not level or level == "native":
        return flags
    from draftverify.errors import require

    require(level in ISA_LEVELS, f"DRAFTVERIFY_ISA={level!r} is not a level: use one of {', '.join(ISA_LEVELS)}")
    needs, above = ISA_LEVELS[level]
    missing = needs - flags
    require(not missing, f"DRAFTVERIFY_ISA={level} needs {', '.join(sorted(missing))}, which this CPU lacks: unset it")
    if level in ("avx2", "avxvnni"):
        above = above | {flag for flag in flags if flag.startswith("avx512")}
    return flags - above


def isa() -> str:
    """The instruction set the kernels are built for here: `avx512vnni`, `avx512`, `avx2`, or `avx2_avxvnni`."""
    wide, vnni, avx_vnni = has_avx512(), has_vnni(), has_avx_vnni()
    return ("avx512vnni" if vnni else "avx512" if wide else "avx2") + ("_avxvnni" if avx_vnni and not vnni else "")


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (then oneDNN's own kernels beat our AVX2 one-row product)."""
    return "avx512f" in cpu_flags()


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (int8 dot products: the q8 products, csrc/products_q8.cpp)."""
    return has_avx512() and {"avx512bw", "avx512_vnni"} <= cpu_flags()


def has_avx_vnni() -> bool:
    """Whether this CPU has AVX-VNNI (256-bit int8 dot products, on CPUs without AVX-512's: the q8 products use it)."""
    return "avx_vnni" in cpu_flags()


def sources() -> list[Path]:
    """The C++ files compiled into the module (the headers they include sit beside them)."""
    return sorted(CSRC.glob("*.cpp"))


def source_tag() -> str:
    """A hash of every source and header, so that any change to one gives a build of its own."""
    digest = hashlib.sha1()
    for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


STALE_LOCK_S = 900  # a build lock older than this was left by a killed build: no build takes that long


def _clear_stale_lock(folder: Path) -> None:
    """torch's builder waits on `folder/lock` while another process builds; a process killed mid-build leaves the
    lock behind and every later process would wait forever. A lock older than any build is removed, with a line."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        print(f"draftverify: removing a stale kernel build lock ({lock}, left by a killed build)", file=sys.stderr)
        lock.unlink(missing_ok=True)


def _flags(wide: bool, vnni: bool, avx_vnni: bool = False) -> list[str]:
    """The compiler flags of a build: AVX2 and FMA, plus AVX-512 (`wide`) and its int8 dot products (`vnni`), or
    the 256-bit int8 dot products of AVX-VNNI (`avx_vnni`)."""
    # -fopenmp: at::parallel_for (csrc/) is OpenMP in torch's CPU build; compiled without it, the
    # pragma is dropped and every product runs on one core. The runtime is torch's own libgomp
    # (same soname, already loaded), so there is one thread pool.
    return [
        "-O3",
        # the arithmetic is what the intrinsics say: left to itself the compiler fuses a multiply and the add after it
        # into one FMA (one rounding fewer) where it sees both, and whether it sees both depends on how much of a
        # kernel's template it unrolls, so one row alone and the same row among others could get different bits
        "-ffp-contract=off",
        "-fopenmp",
        "-mavx2",
        "-mfma",
        "-mf16c",  # F16 weights (products_blocks.cpp); every AVX2 CPU has it
        *(["-mavx512f"] if wide else []),
        *(["-mavx512bw", "-mavx512vnni"] if vnni else []),
        *(["-mavxvnni"] if avx_vnni and not vnni else []),
    ]


def machine_flags() -> list[str]:
    """The compiler flags of this CPU's build (`_flags` of its vector width and int8 dot products)."""
    return _flags(has_avx512(), has_vnni(), has_avx_vnni())


def _compile(load, name: str, folder, flags: list[str]):
    """Build (or load the cached build of) the extension `name` in `folder` with torch's `load`. Raises what the
    build raises."""
    _clear_stale_lock(Path(folder))
    return load(
        name=name,
        sources=[str(path) for path in sources()],
        build_directory=str(folder),
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


BUILT_FILE = "built.json"  # written beside a finished build: what it was built with


def _build_record(flags: list[str]) -> str:
    """What a finished build in a folder was made with, beyond what its name says (the sources' hash and the CPU's
    vector width): the torch it links against and the flags."""
    import torch

    return json.dumps({"torch": torch.__version__, "flags": flags}, sort_keys=True)


def _load_built(folder: Path, name: str, record: str):
    """The finished build in `folder` imported directly, or None when there is none made with `record`.

    torch's `load` rewrites the build file and runs ninja on every call, and the build file names the sources by
    their absolute path, so a checkout elsewhere (another worktree, another venv) of the same sources would rebuild
    a build that is already there. The folder's name fixes the sources and the CPU, `BUILT_FILE` the rest, so a
    build whose record matches is the one `load` would produce: it is imported as it stands."""
    so = folder / f"{name}.so"
    try:
        if (folder / BUILT_FILE).read_text() != record or not so.is_file():
            return None
    except OSError:
        return None
    import torch  # noqa: F401  (the extension links against libtorch: loaded first)

    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record_build(folder: Path, record: str) -> None:
    from draftverify.util import atomic_path

    with atomic_path(folder / BUILT_FILE) as tmp:
        tmp.write_text(record)


_BUILDING = threading.Lock()  # one build or load at a time: a background build (`build_meanwhile`) and a caller


@functools.cache
def cpu():
    """The CPU kernels' module, built once per machine and instruction set (None where they cannot run: `why_not`
    says why). Thread-safe: a caller that comes while another builds waits for that build (the lock) and takes its
    module (`_cpu`'s cache); once built, a call is this cache's lookup alone (the ops call it per forward)."""
    with _BUILDING:
        return _cpu()


def build_meanwhile() -> threading.Thread | None:
    """Build the CPU kernels in a background (daemon) thread unless they are already loaded, so that other slow work
    of a first run (a model's download) overlaps their compile; the caller joins the thread when it needs them."""
    if cpu.cache_info().currsize:
        return None
    thread = threading.Thread(target=cpu, name="draftverify-kernels", daemon=True)
    thread.start()
    return thread


@functools.cache
def _cpu():
    global _why_not
    if os.environ.get("DRAFTVERIFY_KERNELS", "1") == "0":
        _why_not = "DRAFTVERIFY_KERNELS=0"
        return None
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        _why_not = "the CPU kernels need an x86-64 CPU with AVX2 and FMA"
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _why_not = "no C++ compiler (c++) on PATH to build the CPU kernels"
        return None
    from draftverify.util import cache_root

    # 16-lane AVX-512 and int8 dot products where the CPU has them (a per-CPU build)
    name = f"draftverify_cpu_{source_tag()}_{isa()}"
    folder = cache_root() / "kernels" / name
    flags = machine_flags()
    record = _build_record(flags)
    try:
        module = _load_built(folder, name, record)
    except Exception:  # a build that does not import (a truncated file): build it again below
        module = None
    return module if module is not None else _build(folder, name, flags, record)


def _build(folder: Path, name: str, flags: list[str], record: str):
    """Build the extension into `folder` (or let torch's `load` find it there), record it; None with the reason."""
    global _why_not
    try:
        import ninja  # noqa: F401  (torch's extension builder needs it)
        from torch.utils.cpp_extension import load
    except ImportError:
        _why_not = "ninja is not installed (pip install ninja) to build the CPU kernels"
        return None
    fresh = not any(folder.glob("*.so"))
    started = time.monotonic()
    if fresh:
        print(
            "draftverify: compiling the CPU kernels (quantized and one-row matmuls, attention, RMSNorm) once"
            " (a few minutes on 2 cores)...",
            file=sys.stderr,
            flush=True,
        )
    folder.mkdir(parents=True, exist_ok=True)
    try:
        module = _compile(load, name, folder, flags)
    except Exception as exc:  # a compiler error, a missing header: run without the kernel
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _why_not = f"the CPU kernels did not build ({first[:160]})"
        return None
    _record_build(folder, record)
    if fresh:
        print(
            f"draftverify: compiled the CPU kernels in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True
        )
    return module
