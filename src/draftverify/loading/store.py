"""The draft store: what `draftverify build-drafts` made for a target, found by the target's identity and arithmetic.

Layout of a store root: `<root>/<target key>/<arithmetic>/` holds
    head/                     a feature head (`make-draft --kind head`),
    acceptance.safetensors    SpecDec++'s acceptance head for that feature head,
    skipset.json              Draft & Verify's skip set (`search-layers`),
    manifest.json             what was built, when, with which budget, the held-out figures of the build, and the
                              path of each artifact relative to the folder.
`target_key` (the one function that names a target's folder) reads the target's identity (`Loaded.identity`:
architecture, depth, width, vocabulary, tokenizer and embedding fingerprint). A lookup does not trust the name
alone: it reads each manifest's identity and matches it with `util.same_weights` (the rule every file made for
one model is checked by), so an fp16 copy of the same weights finds the build of its fp32 copy.

The roots, searched in order: the user cache (`util.cache_root()/drafts`, written by `build-drafts`) and the
package's own `assets/drafts` (read-only: the artifacts shipped for the default model are listed there by
manifests that point at them). Folders whose name starts with a dot (a build's work folder, a publish in
progress) are never read, so a half-written build is invisible; `publish` moves a finished folder into place
with one rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
from pathlib import Path
from typing import Iterator

from draftverify.util import atomic_write, cache_root, same_weights

MANIFEST = "manifest.json"
STORE_FORMAT = "draftverify-drafts"
STORE_VERSION = 1
ARTIFACTS = ("head", "acceptance", "skipset")  # what a build can make, in the order it makes them
WHAT = {"head": "feature head", "acceptance": "acceptance head", "skipset": "skip set"}
SHIPPED_ROOT = Path(__file__).parent.parent / "assets" / "drafts"
BUILD_MINUTES = 90  # `build-drafts`' default budget: what the one-line error quotes


def user_root() -> Path:
    """Where `build-drafts` publishes: the user cache's `drafts` folder."""
    return cache_root() / "drafts"


def store_roots() -> list[Path]:
    """The roots a lookup searches, in order: the user cache, then the package's shipped artifacts."""
    return [user_root(), SHIPPED_ROOT]


def target_key(identity: dict) -> str:
    """The folder name of a target: its architecture and depth in words, then a hash of its identity's weight keys
    (the fingerprint rounded to one decimal, so that the fp32 and fp16 copies of one model usually share a folder;
    no tokenizer, which a method's identity lacks; lookups match identities by `same_weights` in any case)."""
    fields = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    parts = [str(identity.get(k)) for k in fields] + [f"{float(identity['embedding_fingerprint']):.1f}"]
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
    return f"{identity.get('model_type')}-{identity.get('num_hidden_layers')}l-{digest}"


def read_manifest(folder: Path) -> dict | None:
    """A build folder's manifest, or None when the folder holds no readable one of this format."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        return None
    if manifest.get("version") != STORE_VERSION or not isinstance(manifest.get("artifacts"), dict):
        return None
    return manifest


def builds(identity: dict, arithmetic: str, roots: list[Path] | None = None) -> Iterator[tuple[Path, dict]]:
    """(folder, manifest) of every published build for these weights in `arithmetic`, best first: root by root,
    the folder named by `target_key` first; hidden folders are skipped."""
    key = target_key(identity)
    for root in store_roots() if roots is None else roots:
        if not Path(root).is_dir():
            continue
        names = sorted((p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")), key=str)
        for target in sorted(names, key=lambda p: p.name != key):
            folder = target / arithmetic
            manifest = read_manifest(folder)
            if manifest is not None and same_weights(dict(manifest.get("target", {})), identity):
                yield folder, manifest


def find(
    identity: dict, arithmetic: str, artifact: str, drafter: dict | None = None, roots: list[Path] | None = None
) -> Path | None:
    """The path of `artifact` ("head", "acceptance" or "skipset") built for these weights in `arithmetic`, or None.
    `drafter`: for "acceptance", the identity of the feature head it must have been trained for."""
    for folder, manifest in builds(identity, arithmetic, roots):
        relative = manifest["artifacts"].get(artifact)
        if not relative:
            continue
        if drafter is not None and not same_weights(dict(manifest.get("acceptance_for") or {}), drafter):
            continue
        path = (folder / relative).resolve()
        if path.exists():
            return path
    return None


def describe(path: Path) -> str:
    """A found artifact's name for messages and records: `<target key>/<arithmetic>/<file>` for one in a build
    folder, else its own name (a shipped artifact the shipped manifests point at)."""
    path = Path(path)
    if (path.parent / MANIFEST).is_file():
        return f"{path.parent.parent.name}/{path.parent.name}/{path.name}"
    return path.name


def missing(artifact: str, target: str | None) -> str:
    """The one-line error for a target (`loading.hf.model_source`: its file or folder, "PATH" when unknown) that
    has no `artifact`: the command that builds it, and its budget."""
    known = target not in (None, "PATH")
    return (
        f"no {WHAT[artifact]} for {target if known else 'this target'}: run `draftverify build-drafts --target "
        f"{shlex.quote(target) if known else 'PATH'}` (about {BUILD_MINUTES} minutes)"
    )


def write_manifest(folder: Path, manifest: dict) -> Path:
    """Write a manifest (the format and version stamped) into `folder`, atomically."""
    doc = {"format": STORE_FORMAT, "version": STORE_VERSION, **manifest}
    return atomic_write(Path(folder) / MANIFEST, json.dumps(doc, indent=1) + "\n")


def publish(staging: Path, dest: Path) -> Path:
    """Move a finished build folder `staging` to `dest` with one rename; an earlier `dest` is first renamed to a
    hidden name (never read) and then removed, so a reader sees the old build, the new one or (between the two
    renames) none, never a mix of files of both."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = dest.parent / f".{dest.name}.{secrets.token_hex(4)}.old"
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def staging_folder(dest: Path) -> Path:
    """A new hidden folder beside `dest` (same file system) to assemble a build in before `publish`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    return tmp
