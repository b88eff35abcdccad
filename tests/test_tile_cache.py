"""The packed-weight cache (loading/tile_cache.py) as users run things: loads of a new model at once, a load killed
mid-write, a damaged cache file; and a GGUF embedding's rows read from the file's blocks, bit for bit the packed
weight's rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from draftverify.loading import tile_cache
from draftverify.loading.defaults import default_model_path
from draftverify.loading.gguf import gguf_metadata
from draftverify.loading.gguf_weights import GGUFWeights, rows_of
from draftverify.util import atomic_path, cache_root

# Loads the default model in q8 and greedily decodes; prints whether the packed weights came from the cache.
# "stall": the writer stops after a few tensors (the file half written) and says so, to be killed there.
LOAD = """
import json, sys, time
from pathlib import Path
from draftverify import Engine, costs
from draftverify.loading import tile_cache
costs.cache_folder = lambda: Path(sys.argv[1])
found, load = [], tile_cache.load
tile_cache.load = lambda file: found.append(load(file) is not None) or load(file)
if sys.argv[2] == "stall":
    write, count = tile_cache._write_tensor, [0]
    def stalled(f, t):
        write(f, t)
        count[0] += 1
        if count[0] == 3:
            f.flush()
            print("mid-write", flush=True)
            time.sleep(600)
    tile_cache._write_tensor = stalled
engine = Engine.load(None, "none", dtype="q8")
out = engine.generate("Name three rivers.", method="autoregressive", chat=True, max_new_tokens=8)
print(json.dumps({"tokens": out.tokens, "cached": any(found)}))
"""


def _env(tmp_path: Path) -> dict:
    """A fresh cache home whose compiled kernels are this process's (no rebuild)."""
    home = tmp_path / "xdg"
    (home / "draftverify").mkdir(parents=True)
    (home / "draftverify" / "kernels").symlink_to(cache_root() / "kernels")
    return {**os.environ, "XDG_CACHE_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def _start(tmp_path: Path, env: dict, mode: str = "plain") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LOAD, str(tmp_path / "curves"), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_loads_at_once_and_a_load_killed_mid_write_leave_one_good_cache(tmp_path):
    env = _env(tmp_path)
    stalled = _start(tmp_path, env, "stall")
    assert stalled.stdout.readline().strip() == "mid-write", stalled.stderr.read()[-2000:]
    folder = tmp_path / "xdg" / "draftverify" / "gguf-packed"
    assert list(folder.glob(".*.tmp")) and not list(folder.glob("*.bin"))  # half written, under a temporary name
    both = [_start(tmp_path, env), _start(tmp_path, env)]  # two new loads at once, beside the half-written file
    stalled.send_signal(signal.SIGKILL)
    stalled.wait(timeout=60)
    first, second = (_result(p) for p in both)
    assert not first["cached"] and not second["cached"]  # the temporary was never read
    assert first["tokens"] == second["tokens"]
    (cache,) = folder.glob("*.bin")  # one cache: the last rename won
    assert not list(folder.glob(".*.tmp"))  # the killed writer's temporary was removed
    later = _result(_start(tmp_path, env))
    assert later["cached"] and later["tokens"] == first["tokens"]

    size = cache.stat().st_size  # a damaged file (cut short) is not read, and is written whole again
    with open(cache, "r+b") as f:
        f.truncate(size - 4096)
    again = _result(_start(tmp_path, env))
    assert not again["cached"] and again["tokens"] == first["tokens"]
    assert cache.stat().st_size == size


def test_a_cached_weight_is_the_packed_weight_byte_for_byte(tmp_path):
    path = default_model_path()
    config, _, tokenizer = gguf_metadata(path)
    source = GGUFWeights(path, config, tokenizer)
    names = ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]
    entries = {"fused": source.fused(names, "q8"), "down": [source.linear("layers.1.mlp.down_proj", "q8")]}
    entries["fp32"] = [source.linear("layers.1.mlp.up_proj")]
    file = tmp_path / "packed.bin"
    tile_cache.store(file, entries)
    read = tile_cache.load(file)
    assert read is not None and sorted(read) == sorted(entries)
    for key, weights in entries.items():
        for a, b in zip(weights, read[key], strict=True):
            assert type(a) is type(b)
            for field in a.__dataclass_fields__:
                x, y = getattr(a, field), getattr(b, field)
                assert torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y


def test_embedding_rows_from_the_file_are_the_packed_weights_rows():
    path = default_model_path()
    config, _, tokenizer = gguf_metadata(path)
    source = GGUFWeights(path, config, tokenizer)
    ids = torch.tensor([0, 5, 5, 1000, config.vocab_size - 1, 17])
    whole = rows_of(source._pack("embed_tokens"), ids)
    assert torch.equal(source.rows("embed_tokens", ids), whole)
    assert torch.equal(source.embed_rows(ids), whole)


def test_a_folder_another_process_wrote_meanwhile_receives_the_files(tmp_path):
    """Two first loads of a GGUF file convert its config and tokenizer at once (`gguf_metadata`): the second to
    finish finds the folder made and puts its files in it, rather than failing."""
    folder = tmp_path / "meta"
    with atomic_path(folder, folder=True) as tmp:
        (tmp / "config.json").write_text("ours")
        folder.mkdir()  # the other writer's folder, renamed into place first
        (folder / "config.json").write_text("theirs")
        (folder / "tokenizer.json").write_text("theirs")
    assert (folder / "config.json").read_text() == "ours" and (folder / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["meta"]
