"""The packed weights of a GGUF file kept on disk, so that a later load reads them instead of packing them again.

One file per (GGUF file, arithmetic, kernel build, format): `~/.cache/draftverify/gguf-packed/<stem>-<arithmetic>-
<key>.bin`, the key hashing the GGUF file's `file_key` (path, size, mtime), the arithmetic, the compiled kernels'
build (`kernel_build`: their source hash and instruction set, or none) and `VERSION`. A new download, another
arithmetic or a rebuilt kernel names another file, so nothing packed for other bits is ever read.

Layout: `MAGIC`, the header's length (u64), the header (JSON: version, key, the blob's length, and per entry its key
and its weights: class, fields, and for each tensor its offset in the blob, dtype and shape), zeros to `ALIGN`, then
the blob (each tensor's bytes, 64-byte aligned). A load reads the header, checks its version, key and that the
file holds exactly header and blob, and reads the blob in one pass into a buffer on 2 MB pages (`kernels.q8`'s, as
the packed weights' arena is): the tensors are views of it, the same bytes the packing made, so the same products.

Writing is safe against concurrent loads and killed processes: the file is written under a temporary name in the
same folder (`.<name>.<pid>.tmp`), fsynced, then renamed over the final name (atomic), so a reader sees a whole file
or none; two processes that pack the same model at once each rename a whole file, and the last rename wins. A
process killed mid-write leaves only its temporary, which no load reads and the next writer removes (its pid gone).
A cache that cannot be written (a full disk, a read-only home) is named once on stderr; the load goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
import struct
import sys
from pathlib import Path

import numpy as np
import torch

MAGIC = b"DVPACK01"
VERSION = 1
ALIGN = 2 << 20  # the blob starts on a 2 MB boundary of the file (a large folio's, where the file system has them)
_LEN = struct.Struct("<Q")
DTYPES = {str(d): d for d in (torch.uint8, torch.float16, torch.float32, torch.bfloat16, torch.int8)}


def kernel_build() -> str:
    """What names the compiled kernels' build (their sources' hash and instruction set), "none" without them: the q8
    tiles' layout is theirs."""
    from draftverify.kernels import cpu, isa, source_tag

    return f"{source_tag()}_{isa()}" if cpu() is not None else "none"


def cache_file(path: Path, arithmetic: str) -> Path:
    """Where the packed weights of the GGUF file at `path`, in `arithmetic`, are cached."""
    from draftverify.util import cache_root, file_key

    key = hashlib.sha1(f"{file_key(path)}:{arithmetic}:{kernel_build()}:{VERSION}".encode()).hexdigest()[:16]
    return cache_root() / "gguf-packed" / f"{path.stem}-{arithmetic}-{key}.bin"


def load(file: Path) -> dict[str, list] | None:
    """The cached entries of `file` (entry key -> its weights), or None where there is no whole cache of this key."""
    try:
        with open(file, "rb") as f:
            head = f.read(len(MAGIC) + _LEN.size)
            if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
                return None
            header = json.loads(f.read(_LEN.unpack_from(head, len(MAGIC))[0]))
            start = -(-f.tell() // ALIGN) * ALIGN
            whole = os.fstat(f.fileno()).st_size == start + header["blob"]
            if header.get("version") != VERSION or header.get("key") != file.name or not whole:
                return None
            blob = _map_blob(f, start, header["blob"])
        return {e["key"]: [_weight(w, blob) for w in e["weights"]] for e in header["entries"]}
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):  # not a cache this version wrote whole
        return None


def _map_blob(f, start: int, nbytes: int) -> torch.Tensor:
    """The blob, uint8 [nbytes], a private read-only-in-practice map of the file: its pages are the page cache's,
    shared by every process that maps this cache, read on first touch, and never a second copy in the process."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: nothing here can write the file
    for advice in ("MADV_HUGEPAGE", "MADV_WILLNEED"):  # large folios where the file system has them; read ahead
        if hasattr(mmap, advice):
            mapped.madvise(getattr(mmap, advice), start, nbytes)
    return torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=start))


def _weight(spec: dict, blob: torch.Tensor):
    from draftverify.kernels.blocks import PackedWeight
    from draftverify.kernels.q8 import Q8Weight

    cls = {"PackedWeight": PackedWeight, "Q8Weight": Q8Weight}[spec["class"]]
    fields = {}
    for name, value in spec["fields"].items():
        if isinstance(value, dict):  # a tensor: {"at": offset, "dtype": ..., "shape": [...]}
            dtype, shape = DTYPES[value["dtype"]], value["shape"]
            n = math.prod(shape) * dtype.itemsize
            at = value["at"]
            value = blob[at : at + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
        elif isinstance(value, list):
            value = tuple(value)
        fields[name] = value
    return cls(**fields)


def store(file: Path, entries: dict[str, list]) -> None:
    """Write `entries` (entry key -> its weights: PackedWeights, Q8Weights) to `file` atomically (module docstring);
    a failure is named on stderr and leaves no file behind."""
    file.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(file)
    tmp = file.parent / f".{file.name}.{os.getpid()}.tmp"
    tensors: list[torch.Tensor] = []
    placed: dict[tuple, int] = {}  # a tensor's (address, bytes, dtype, shape) -> its offset: written once
    described = [{"key": key, "weights": [_describe(w, tensors, placed) for w in ws]} for key, ws in entries.items()]
    end = max((placed[_ident(t)] + t.numel() * t.element_size() for t in tensors), default=0)
    header = json.dumps({"version": VERSION, "key": file.name, "blob": end, "entries": described}).encode()
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header)
            start = -(-f.tell() // ALIGN) * ALIGN
            for t in tensors:
                f.seek(start + placed[_ident(t)])
                _write_tensor(f, t)
            f.truncate(start + end)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
        _sync_folder(file.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"draftverify: packed weights not cached in {file.parent} ({exc})", file=sys.stderr, flush=True)


def _write_tensor(f, t: torch.Tensor) -> None:
    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _ident(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.numel() * t.element_size(), str(t.dtype), tuple(t.shape))


def _describe(w, tensors: list[torch.Tensor], placed: dict[tuple, int]) -> dict:
    fields = {}
    for field in dataclasses.fields(w):
        value = getattr(w, field.name)
        if isinstance(value, torch.Tensor):
            key = _ident(value)
            if value.numel() and key not in placed:
                last = tensors[-1] if tensors else None
                end = placed[_ident(last)] + last.numel() * last.element_size() if last is not None else 0
                placed[key] = -(-end // 64) * 64
                tensors.append(value)
            value = {"at": placed.get(key, 0), "dtype": str(value.dtype), "shape": list(value.shape)}
        fields[field.name] = value
    return {"class": type(w).__name__, "fields": fields}


def _remove_orphans(file: Path) -> None:
    """Remove temporaries of `file` whose writer is gone (killed mid-write)."""
    for tmp in file.parent.glob(f".{file.name}.*.tmp"):
        pid = tmp.name[len(file.name) + 2 : -len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sync_folder(folder: Path) -> None:
    """The rename itself reaches the disk (a crash after it keeps the new name)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
