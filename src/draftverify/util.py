"""Small helpers shared by the runtime and the offline tools (no torch, no transformers here).

- `atomic_path` / `atomic_write`: write a file (or a folder) so that a crash leaves the old
  version or the new one, never half of one;
- `same_weights` / `describe_identity`: is a file made for one model (a skip set, an
  acceptance head, a draft without embeddings) used with that model? One rule, one tolerance;
- `eos_ids`: the tokens that end a model's reply;
- `cache_root`: where converted models, compiled kernels and training caches are kept;
- `optional_import`: a dependency of one extra (plots, the tools, the server), imported where it is used;
- `trim_heap`: freed heap memory back to the system (after a load's transient allocations);
- `command_line`: a report's command as a user retypes it (the settings of the environment that change what runs
  included).
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import secrets
import shlex
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# The same weights in fp32, bf16 or fp16 give embedding fingerprints (`loading.model_identity`:
# a sum over 64 embedding rows, rounded to 3 decimals) this close; other weights do not.
FINGERPRINT_REL_TOL = 1e-2
FINGERPRINT_ABS_TOL = 0.05
IDENTITY_KEYS = ("model_type", "num_hidden_layers", "embedding_fingerprint")  # what every identity must give


# -- files ------------------------------------------------------------------------------------


@contextmanager
def atomic_path(path: str | Path, folder: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write instead of `path`; it replaces `path` when the block ends
    without error and is removed when it raises.

    The temporary is a hidden name beside `path` (same file system, so the rename is atomic) and
    does not exist yet: the writer creates it. With `folder=True` it is an empty folder; a new
    `path` is then renamed into place as a whole, while an existing folder `path` receives the
    temporary's files one by one (each rename atomic), keeping files it has that were not
    written, and holds the temporary itself so that no access to its parent is needed; a new `path`
    that another process made meanwhile receives them the same way.
    Parent folders are created.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    merge = folder and path.is_dir()
    tmp = (path if merge else path.parent) / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        if folder:
            tmp.mkdir()
        yield tmp
        if not merge:
            try:
                os.replace(tmp, path)
            except OSError:  # another process wrote the folder meanwhile (loads at once): its files get ours
                if not (folder and path.is_dir()):
                    raise
                merge = True
        if merge:
            for item in sorted(tmp.iterdir()):
                os.replace(item, path / item.name)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write text (UTF-8) or bytes to `path` atomically (see `atomic_path`); returns `path`."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def cache_root() -> Path:
    """Where converted GGUF models and other caches are kept: `$XDG_CACHE_HOME/draftverify` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "draftverify"


# -- model identity ---------------------------------------------------------------------------


def same_weights(a: dict, b: dict) -> bool:
    """Do two model identities (`loading.model_identity`, `Loaded.identity`) name the same weights?

    Both must give the architecture, the depth and the embedding fingerprint, and every key both
    give must agree (the identity a method sees has no tokenizer key; a file's may have one).
    Fingerprints agree within `FINGERPRINT_REL_TOL` / `FINGERPRINT_ABS_TOL` (`math.isclose`),
    because fp32, bf16 and fp16 copies of one model round them differently.
    """
    shared = set(a) & set(b)
    if not set(IDENTITY_KEYS) <= shared:
        return False
    for key in shared:
        if key == "embedding_fingerprint":
            try:
                close = math.isclose(
                    float(a[key]), float(b[key]), rel_tol=FINGERPRINT_REL_TOL, abs_tol=FINGERPRINT_ABS_TOL
                )
            except (TypeError, ValueError):
                return False
            if not close:
                return False
        elif a[key] != b[key]:
            return False
    return True


def describe_identity(identity: dict) -> str:
    """An identity in words, for the error that refuses a file made for another model."""
    return (
        f"{identity.get('model_type')}, {identity.get('num_hidden_layers')} layers, hidden "
        f"{identity.get('hidden_size')}, "
        f"fingerprint {identity.get('embedding_fingerprint')}"
    )


def eos_ids(loaded) -> tuple[int, ...]:
    """The tokens that end a reply of `loaded` (a `loading.Loaded`): the EOS ids of its generation
    config and of its tokenizer, sorted."""
    ids = set()
    for source in (loaded.model.generation_config.eos_token_id, loaded.tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
    return tuple(sorted(ids))


# -- optional dependencies ----------------------------------------------------------------------


def optional_import(module: str, extra: str):
    """`module`, imported; where it is missing, a one-line error naming the extra that installs it. The runtime
    needs only what decoding needs: plots, the search's optimiser and the server come with extras."""
    from draftverify.errors import DraftVerifyError

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise DraftVerifyError(f"{top} is not installed: pip install 'draftverify[{extra}]'") from exc


# Environment variables that change what a run computes or how fast: our kernels' instruction set and whether they
# are used, and the instruction sets torch's and oneDNN's own kernels are held to.
RUN_ENV = ("DRAFTVERIFY_ISA", "DRAFTVERIFY_KERNELS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def command_line(prog: str, argv: list[str]) -> str:
    """`prog argv...` as a user would type it again, after the `RUN_ENV` settings this process runs under."""
    settings = [f"{name}={shlex.quote(os.environ[name])}" for name in RUN_ENV if os.environ.get(name)]
    return " ".join([*settings, prog, shlex.join(argv)])


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; nothing elsewhere). Parsing a large
    tokenizer JSON frees tens of MB that glibc would otherwise keep resident for the rest of the process."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: glibc's where it is the C library
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows): nothing to trim
        pass


def file_key(path: Path) -> str:
    """What names a file's caches: its resolved path, size and mtime (a new download gets a new key)."""
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
