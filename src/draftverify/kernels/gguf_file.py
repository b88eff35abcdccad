"""A GGUF file read straight from disk: header, metadata and tensor infos parsed here, the file memory-mapped, each
tensor's raw blocks a numpy view of the map (no copy; the pages are read when a kernel or a packer touches them).

The `gguf` package's `GGUFReader` builds a numpy view for every element of every metadata array, which for a
tokenizer's tens of thousands of strings takes seconds; here an array of strings is only skipped over (its lengths
walked) until its value is asked for, and a numeric array is a view of the map.

    f = GGUFFile(path)
    f.value("general.architecture")      # "llama"
    t = f.tensors["blk.0.attn_q.weight"]  # TensorInfo: name, ggml_type, type_name, shape (rows first), raw
    t.raw                                 # uint8 [rows..., bytes a row]: the file's blocks, a view of the map
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: (struct code, numpy dtype) for the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands (the message says what and where)."""


def type_name(ggml_type: int) -> str:
    """The GGML type's name ("Q4_K"), or "type N" for a number this gguf package does not know."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in numpy order (rows first: [out, in] for a linear weight), `offset` in the file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    _file: GGUFFile

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def raw(self) -> np.ndarray:
        """The tensor's bytes as uint8 [rows..., bytes a row] (blocks of the innermost dimension), a view of the map."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        row_bytes = self.shape[-1] // block * size
        flat = self._file.data[self.offset : self.offset + self.nbytes]
        return flat.reshape(*self.shape[:-1], row_bytes)


class GGUFFile:
    """A GGUF file, memory-mapped: `tensors` (name -> TensorInfo, in file order), `keys()`, `value(key)`;
    `release()` drops its pages from the process's resident memory once what was read from them is packed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GGUFError(f"cannot map {self.path} ({exc}): pass the path of a readable .gguf file") from exc
        self._buf = memoryview(self.data)
        self._pos = 0
        magic = bytes(self._take(4))
        if magic != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (starts with {magic!r}, not b'GGUF')")
        self.version = self._scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        self._fields: dict[str, tuple[int, int]] = {}  # key -> (value type, offset of the value)
        for _ in range(n_fields):
            key = self._string()
            kind = self._scalar("<I")
            self._fields[key] = (kind, self._pos)
            self._skip(kind)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.value("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset in infos:
            nbytes = _nbytes(name, ggml_type, shape)
            if start + offset + nbytes > len(self.data):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file (truncated download?)")
            self.tensors[name] = TensorInfo(name, ggml_type, shape, start + offset, nbytes, self)

    # ---- metadata
    def release(self) -> None:
        """Let go of the mapped pages read so far (a later read maps them again from the page cache): the bytes
        were packed into the kernels' layouts, so keeping them resident would count the weights twice."""
        handle = getattr(self.data, "_mmap", None)
        if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
            handle.madvise(mmap.MADV_DONTNEED)

    def keys(self) -> list[str]:
        return list(self._fields)

    def value(self, key: str, default=None):
        """The metadata value: a Python scalar or str, a list of str, or a numpy array (a view of the map)."""
        if key not in self._fields:
            return default
        kind, offset = self._fields[key]
        self._pos = offset
        return self._read(kind)

    @cached_property
    def metadata(self) -> dict:
        """Every metadata value decoded (the big arrays too: prefer `value(key)` for what you need)."""
        return {key: self.value(key) for key in self._fields}

    # ---- parsing
    def _take(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise GGUFError(f"{self.path}: the header ends early at byte {self._pos} (truncated file?)")
        view = self._buf[self._pos : self._pos + n]
        self._pos += n
        return view

    def _scalar(self, code: str):
        (value,) = struct.unpack_from(code, self._take(struct.calcsize(code)))
        return value

    def _string(self) -> str:
        return bytes(self._take(self._scalar("<Q"))).decode("utf-8", errors="replace")

    def _skip(self, kind: int) -> None:
        if kind in _SCALARS:
            self._pos += struct.calcsize(_SCALARS[kind][0])
        elif kind == _STRING:
            length = self._scalar("<Q")  # read before `_pos` is: `_pos += self._scalar()` would drop the 8 bytes
            self._pos += length
        elif kind == _ARRAY:
            inner, count = self._scalar("<I"), self._scalar("<Q")
            if inner in _SCALARS:
                self._pos += count * np.dtype(_SCALARS[inner][1]).itemsize
            elif inner == _STRING:  # a tokenizer's vocabulary: only the lengths are read
                pos, length, buf = self._pos, _U64.unpack_from, self._buf
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self._pos = pos
            else:
                for _ in range(count):
                    self._skip(inner)
        else:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind} at byte {self._pos}")

    def _read(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind} at byte {self._pos}")
        inner, count = self._scalar("<I"), self._scalar("<Q")
        if inner in _SCALARS:
            dtype = np.dtype(_SCALARS[inner][1]).newbyteorder("<")
            return self.data[self._pos : self._pos + count * dtype.itemsize].view(dtype)
        return [self._read(inner) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._string()
        dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
        ggml_type, offset = self._scalar("<I"), self._scalar("<Q")
        return name, ggml_type, tuple(reversed(dims)), offset


def _nbytes(name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor {name} has GGML type {ggml_type}, unknown to the installed gguf package") from None
    if not shape or shape[-1] % block:
        raise GGUFError(f"tensor {name} ({type_name(ggml_type)}): {shape} is not whole blocks of {block}")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size
