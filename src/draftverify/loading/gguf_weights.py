"""A GGUF file as a weight source for the static path: its blocks packed straight from the memory-mapped file.

`GGUFWeights(path)` gives, by the recipe's logical names (those of the stock transformers module, e.g.
"layers.3.self_attn.q_proj"), `linear(name)` a `kernels.blocks.PackedWeight` (the file's blocks, never an fp32
copy of a quantized weight; a type with no block kernel is dequantized to fp32 and named once on stderr),
`bias(name)` / `vector(name)` fp32 tensors, `embed_rows(ids)` the token embedding's rows (only those rows
dequantized), `head` the output head's PackedWeight (the embedding's when tied), plus `config` (a transformers
config) and `tokenizer`.

Architectures: Llama (Mistral), Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3, each a table of tensor names
(`LAYER_TENSORS`); Phi-3's fused attn_qkv and gate|up ffn_up are read whole, as its stock module holds them.

Exactness: every PackedWeight dequantizes to the bits gguf's dequantization gives (kernels/blocks.py), which is
what transformers' GGUF loader feeds the stock model; the q and k rows of a "llama" file are permuted as that
loader permutes them (`_rope_rows`), and a row permutation moves whole rows of blocks, so it changes no bits.
Gemma's norm vectors are the file's minus 1 in fp32, as that loader subtracts it (`NORM_SHIFT`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from draftverify.errors import require
from draftverify.kernels.blocks import PackedWeight, pack
from draftverify.kernels.gguf_file import GGUFFile
from draftverify.kernels.q8 import TileArena
from draftverify.loading import tile_cache

# Logical name (inside a layer) -> GGUF tensor name (inside "blk.N."), per GGUF architecture: the names
# llama.cpp's converter writes (gguf's tensor name map), as transformers' GGUF loader reads them back.
_LLAMA_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# Gemma's four norms a layer: the one after attention is "post_attention_norm", the one before the MLP "ffn_norm".
_GEMMA_LAYER = _LLAMA_LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Phi-3 keeps q|k|v in one tensor and gate|up in another (gate's rows first), as its stock module does.
_PHI3_LAYER = _LLAMA_LAYER | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
LAYER_TENSORS = {
    "llama": _LLAMA_LAYER,
    "qwen2": _LLAMA_LAYER,
    "qwen3": _LLAMA_LAYER,
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
    "phi3": _PHI3_LAYER,
}
TOP_TENSORS = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
DIRECT_ARCHITECTURES = tuple(LAYER_TENSORS)  # GGUF architectures whose blocks the static path reads directly
# llama.cpp's converter stores a Gemma RMSNorm weight w as w + 1; transformers' loader (Gemma2TensorProcessor)
# subtracts 1 in fp32 from every "*norm.weight", and the stock module scales by 1 + w: the same two roundings here.
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}
SCALED_EMBEDDINGS = ("gemma2", "gemma3")  # the stock embedding multiplies its rows by fp32(sqrt(hidden size))


def gguf_name(name: str, suffix: str = "weight", architecture: str = "llama") -> str:
    """The GGUF tensor name of a logical one: "layers.3.mlp.up_proj" -> "blk.3.ffn_up.weight"."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        table = LAYER_TENSORS[architecture]
        require(rest in table, f"no GGUF tensor is known for {name!r} ({architecture}): extend loading.gguf_weights")
        return f"blk.{index}.{table[rest]}.{suffix}"
    require(name in TOP_TENSORS, f"no GGUF tensor is known for {name!r}: extend loading.gguf_weights")
    return f"{TOP_TENSORS[name]}.{suffix}"


class GGUFWeights:
    """The weights of one GGUF file by logical name (see the module docstring). Packs each weight once, on first
    use, and shares it with every decoder built from this source (a truncated draft of the target included)."""

    def __init__(self, path: str | Path, config, tokenizer=None, file: GGUFFile | None = None, cache: bool = False):
        self.path = Path(path)
        self.file = file if file is not None else GGUFFile(self.path)  # `file`: this path, already opened
        self.config = config
        self.tokenizer = tokenizer
        self.architecture = self.file.value("general.architecture")
        require(
            self.architecture in DIRECT_ARCHITECTURES,
            f"{self.path.name}: architecture {self.architecture!r} is not read directly (the static path reads "
            f"{', '.join(DIRECT_ARCHITECTURES)}): load it with backend='eager'",
        )
        self.tied = "output.weight" not in self.file.tensors
        self._packed: dict[tuple[str, str], object] = {}  # (name, arithmetic) -> its weight, as `linear` gives it
        self._fused: dict[tuple, list] = {}  # `fused`: shared by every decoder of the file
        self._tiles = TileArena()  # the q8 tiles of every weight, on 2 MB pages (`kernels.q8.TileArena`)
        self._said: set[str] = set()
        # `cache`: packed weights are read from and kept in the user cache (loading/tile_cache.py), per arithmetic
        self._cache = {} if cache else None  # arithmetic -> the cached entries (entry key -> weights), {} when none
        self._missed: set[str] = set()  # the arithmetics something was packed in since the cache was read

    def name(self, name: str, suffix: str = "weight") -> str:
        """The GGUF tensor name of the logical `name` in this file's architecture."""
        return gguf_name(name, suffix, self.architecture)

    def has(self, name: str, suffix: str = "weight") -> bool:
        return self.name(name, suffix) in self.file.tensors

    def linear(self, name: str, arithmetic: str = "fp32"):
        """The weight [out, in] of the logical linear `name`, packed from the file's blocks (once, or read from the
        cache): a PackedWeight, or in the q8 arithmetic the form its product takes (`backend.linear.for_arithmetic`;
        the PackedWeight is then not kept beside it unless something asked for it in fp32)."""
        if name == "lm_head" and self.tied:
            name = "embed_tokens"
        found = self._packed.get((name, arithmetic))
        if found is None:
            from draftverify.backend.linear import for_arithmetic

            cached = self._cached(arithmetic, ["linear", name])
            found = cached[0] if cached else self._placed(for_arithmetic(self._fp32(name), arithmetic, self._tiles))
            self._packed[name, arithmetic] = found
        return found

    def _fp32(self, name: str) -> PackedWeight:
        """The PackedWeight of `name`: the one kept for the fp32 arithmetic, else packed now and not kept."""
        found = self._packed.get((name, "fp32"))
        return found if found is not None else self._pack(name)

    def _pack(self, name: str) -> PackedWeight:
        info = self._tensor(self.name(name))
        raw, rows = info.raw, self._rope_rows(name, int(info.shape[0]))
        if rows is not None:  # whole rows of blocks move (exact): one gather of the file's bytes, before packing
            raw = np.ascontiguousarray(raw).view(np.uint8).reshape(len(rows), -1)[rows]
        found = pack(raw, info.ggml_type, info.shape)
        if found.reason is not None and found.reason not in self._said:
            self._said.add(found.reason)
            print(f"draftverify: {self.path.name}: {found.reason}", file=sys.stderr, flush=True)
        return found

    def fused(self, names: list[str], arithmetic: str = "fp32") -> list:
        """The weights `names` fused along out as `backend.linear.BlockLinear` multiplies them (runs of one layout
        concatenated, `concat_runs`, each in `arithmetic`'s form), made once; a part packed only for the fusion is
        not kept beside it."""
        key = (tuple(names), arithmetic)
        found = self._fused.get(key)
        if found is None:
            from draftverify.backend.linear import concat_runs, for_arithmetic

            found = self._cached(arithmetic, ["fused", list(names)])
            if found is None:
                parts = [self._fp32(n) for n in names]
                found = [self._placed(for_arithmetic(w, arithmetic, self._tiles)) for w in concat_runs(parts)]
            self._fused[key] = found
        return found

    def _cached(self, arithmetic: str, key: list) -> list | None:
        """The weights of entry `key` from this file's cache in `arithmetic` (read on first use), or None: then the
        caller packs them, and `packed()` writes the cache again."""
        if self._cache is None:
            return None
        if arithmetic not in self._cache:
            self._cache[arithmetic] = tile_cache.load(tile_cache.cache_file(self.path, arithmetic)) or {}
        found = self._cache[arithmetic].get(json.dumps(key))
        if found is None:
            self._missed.add(arithmetic)
        return found

    def packed(self) -> None:
        """A decoder has every weight it multiplies: the file's pages leave resident memory (`release`), and the
        weights packed in an arithmetic the cache did not hold whole are written to it (all that arithmetic's
        weights, so the next load reads them all)."""
        self.release()
        for arithmetic in sorted(self._missed):
            entries = {json.dumps(["linear", n]): [w] for (n, a), w in self._packed.items() if a == arithmetic}
            entries |= {json.dumps(["fused", list(n)]): ws for (n, a), ws in self._fused.items() if a == arithmetic}
            tile_cache.store(tile_cache.cache_file(self.path, arithmetic), entries)
            self._cache[arithmetic] = entries
        self._missed.clear()

    def _placed(self, w):
        """A PackedWeight multiplied as it is (the fp32 arithmetic's, or a layout q8 does not take) with its codes and
        scales copied into the arena, on 2 MB pages as the q8 tiles are; a q8 weight is there already."""
        if not isinstance(w, PackedWeight):
            return w
        place = self._tiles.place
        return dataclasses.replace(w, codes=place(w.codes), d=place(w.d), m=place(w.m))

    def shape(self, name: str) -> tuple[int, int]:
        """[out, in] of the logical linear `name`, read from the file (nothing packed)."""
        return tuple(int(n) for n in self._tensor(self.name(name)).shape)

    def release(self) -> None:
        """The file's pages read so far leave resident memory (`GGUFFile.release`): call once the weights are packed."""
        self.file.release()

    def bias(self, name: str) -> torch.Tensor | None:
        return self._dense(self.name(name, "bias")) if self.has(name, "bias") else None

    def vector(self, name: str) -> torch.Tensor:
        """A 1-D fp32 weight (a norm's scale) as the stock module holds it (Gemma's: the file's value - 1)."""
        full = self.name(name)
        found = self._dense(full)
        shift = NORM_SHIFT.get(self.architecture)
        return found - shift if shift and full.endswith("norm.weight") else found

    @property
    def embed_scale(self) -> float | None:
        """What the stock embedding multiplies its rows by (Gemma: sqrt(hidden size)), or None."""
        return self.config.hidden_size**0.5 if self.architecture in SCALED_EMBEDDINGS else None

    def head(self, arithmetic: str = "fp32"):
        return self.linear("lm_head", arithmetic)

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of the logical weight `name`, fp32 [n, in]: from its fp32 PackedWeight when one is kept, else
        only those rows' blocks packed from the file (a row's blocks alone decide its values: the same bits)."""
        if name == "lm_head" and self.tied:
            name = "embed_tokens"
        kept = self._packed.get((name, "fp32"))
        if kept is not None:
            return rows_of(kept, ids)
        info = self._tensor(self.name(name))
        if ids.numel() == 0:  # no rows (an empty input): nothing to pack
            return torch.empty(0, int(info.shape[1]), dtype=torch.float32)
        order = self._rope_rows(name, int(info.shape[0]))
        picked = ids.numpy() if order is None else order[ids.numpy()]
        part = pack(np.ascontiguousarray(info.raw[picked]), info.ggml_type, (len(picked), int(info.shape[1])))
        return part.dequantize()

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of token ids [n] -> fp32 [n, H], only those rows dequantized (exact)."""
        return self.rows("embed_tokens", ids.view(-1).cpu())

    def _tensor(self, full: str):
        info = self.file.tensors.get(full)
        require(info is not None, f"{self.path.name} has no tensor {full}: the file is incomplete or not this model")
        return info

    def _dense(self, full: str) -> torch.Tensor:
        """A small tensor (a norm, a bias) as fp32, dequantized as transformers' loader does when not F32."""
        info = self._tensor(full)
        if info.ggml_type == 0:  # F32
            return torch.from_numpy(np.array(info.raw.view(np.float32).reshape(info.shape), copy=True))
        return torch.from_numpy(np.array(dequantize(info.raw, info.ggml_type), dtype=np.float32).reshape(info.shape))

    def _rope_rows(self, name: str, out: int) -> np.ndarray | None:
        """The row order transformers' GGUF loader gives q and k of a "llama" file (llama.cpp's converter
        interleaves each head's rotary halves; the loader undoes it), or None for every other weight."""
        if self.architecture != "llama" or not name.endswith(("q_proj", "k_proj")):
            return None
        heads = self.config.num_attention_heads if name.endswith("q_proj") else self.config.num_key_value_heads
        dim = out // heads // 2
        return np.arange(out).reshape(heads, dim, 2).swapaxes(2, 1).reshape(out)


def rows_of(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of `w`'s dequantized weight, fp32 [n, in]: the same bits as `w.dequantize()[ids]`."""
    pick = lambda t: t[ids] if t.numel() else t  # noqa: E731
    part = PackedWeight(w.type_name, (ids.shape[0], w.shape[1]), w.layout, w.sub, pick(w.codes), pick(w.d), pick(w.m))
    return part.dequantize()
