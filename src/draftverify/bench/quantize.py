"""The default model in the GGUF types people download, written by llama.cpp's own quantizer.

`quantized("Q4_K_M")` returns the path of the default model (SmolLM2-135M-Instruct) quantized
to that type by `llama_model_quantize` (llama-cpp-python, the optional llama.cpp extra), from the
F32 re-export of the shipped Q4_1 file (`llamacpp.f32_gguf`), so that every type is quantized
once from the same weights rather than re-quantized from already rounded blocks. Files are
cached like the F32 export: named by the source file's key (path, size, modification time) and
the type, written under a temporary name and renamed, so a reader never sees half a file.

    python -m draftverify.bench.quantize [TYPE ...]    # default: Q4_K_M Q5_K_M Q6_K Q8_0
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftverify.bench.llamacpp import f32_gguf, require_llamacpp, source_key
from draftverify.errors import DraftVerifyError, require
from draftverify.util import atomic_path, cache_root

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")  # what GGUF repositories ship most; Q4_K_M their usual default


def ftype(name: str) -> int:
    """llama.cpp's file-type number of a type name (`Q4_K_M` -> LLAMA_FTYPE_MOSTLY_Q4_K_M)."""
    import llama_cpp

    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}", None)
    require(value is not None, f"unknown GGUF type {name!r}: use one of {', '.join(TYPES)} (or another llama.cpp type)")
    return int(value)


def quantize(source: Path, out: Path, name: str, threads: int = 0) -> Path:
    """Write `source` (a GGUF) quantized to type `name` at `out`, atomically; returns `out`."""
    import ctypes

    import llama_cpp

    require_llamacpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype(name)
    params.nthread = threads  # 0: llama.cpp's own choice
    params.allow_requantize = True  # a quantized source (not the F32 export) is accepted too
    with atomic_path(out) as tmp:
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if code != 0 or not tmp.is_file():
            raise DraftVerifyError(f"llama.cpp could not quantize {source} to {name} (code {code}): check the file")
    return out


def quantized(name: str, source: Path | None = None) -> Path:
    """The GGUF of `source` (default: the default model) in type `name`, made once from its F32 re-export, cached."""
    from draftverify.loading.known import resolve_model

    require_llamacpp()
    source = resolve_model(source)
    require(source.suffix == ".gguf", f"{source} is not a .gguf file: pass a GGUF model to quantize")
    name = name.upper()
    ftype(name)  # refuse an unknown type before any conversion
    out = cache_root() / "gguf-quantized" / f"{source.stem}-{source_key(source)}.{name}.gguf"
    return out if out.is_file() else quantize(f32_gguf(source), out, name)


def main(argv: list[str]) -> int:
    for name in argv or TYPES:
        print(quantized(name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
