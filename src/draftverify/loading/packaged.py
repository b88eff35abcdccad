"""A model file shipped as slices in PyPI wheels: what `known.py` lists and `fetch.py` assembles (kept apart from
both so that neither imports the other for its types)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI and the slice of the model's file it holds at `member`."""

    package: str  # the distribution's name on PyPI
    version: str
    member: str  # the slice's path inside the wheel
    sha256: str  # of the slice
    size: int  # bytes of the slice

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file by short name: its file name in the cache, its sha256 and the wheels that hold it."""

    name: str  # the short name users type
    file: str  # the file's name in the cache (`fetch.models_dir()`)
    sha256: str  # of the whole file
    parts: tuple[Part, ...]
    about: str  # one line: what the model is
    package: str | None = None  # an installed package that already holds the file (the default model's)

    def __post_init__(self):
        if not self.parts or not self.file.endswith(".gguf"):
            raise ValueError(f"known model {self.name}: give its parts and a .gguf file name")

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)
