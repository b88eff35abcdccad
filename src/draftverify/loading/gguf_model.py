"""`GGUFModel`: a GGUF target as the static path runs it, straight from the file's blocks.

It stands where the stock transformers module stands (a `Runner`'s model, `Loaded.model`) and answers what
the code above the backends asks of a model: `config`, `generation_config`, `get_input_embeddings()` /
`get_output_embeddings()` (a `RowEmbedding`: a lookup dequantizes only the rows asked for, Gemma's input rows
scaled as the stock embedding scales them; `.weight`, the whole fp32 table, is built only for a caller that asks
for it, never on the generate path, and shared), and `weight_source` (the `GGUFWeights` the static decoder packs
from). The stock module is built only by `stock()`, for what needs one (the eager path, the tools), from the fp32
conversion (loading/gguf.py), and kept.
"""

from __future__ import annotations

import copy
import importlib

import torch

from draftverify.loading.gguf_weights import GGUFWeights
from draftverify.loading.plain_config import transformers_config

# A lookup of at most this many ids (a decoding step's, a draft's) reads rows kept from earlier lookups; a longer
# one (a prompt) dequantizes its rows in one go. At most KEPT_ROWS rows are kept per embedding (then it starts over).
FEW_IDS = 64
KEPT_ROWS = 8192


class RowEmbedding(torch.nn.Module):
    """An embedding (or a tied head) read from the file: `forward(ids)` dequantizes only those rows (exact), and keeps
    the rows of short lookups: a row is the same bits however it was dequantized, and a decoding step would otherwise
    pay a dozen small ops for one row."""

    def __init__(self, source: GGUFWeights, name: str, scale: float | None = None):
        super().__init__()
        self.source, self.name = source, name
        self.num_embeddings, self.embedding_dim = source.shape(name)
        # Gemma's scaled embedding: the rows times the scale rounded to fp32, as the stock module's buffer holds it
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        self._kept: dict[int, torch.Tensor] = {}  # id -> its row [H] (scaled), from short lookups

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        flat = ids.reshape(-1).cpu()
        if 0 < flat.numel() <= FEW_IDS:
            return self._few(flat.tolist()).view(*ids.shape, self.embedding_dim)
        return self._scaled(self.source.rows(self.name, flat)).view(*ids.shape, self.embedding_dim)

    def _few(self, ids: list[int]) -> torch.Tensor:
        """Rows [n, H] of a few ids, each dequantized once and kept."""
        kept = self._kept
        missing = list(dict.fromkeys(i for i in ids if i not in kept))
        if missing:
            if len(kept) + len(missing) > KEPT_ROWS:  # start over with this lookup's rows
                kept.clear()
                missing = list(dict.fromkeys(ids))
            rows = self._scaled(self.source.rows(self.name, torch.tensor(missing)))
            kept.update(zip(missing, rows))
        return kept[ids[0]][None].clone() if len(ids) == 1 else torch.stack([kept[i] for i in ids])  # the caller's own

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.scale is None else rows * self.scale

    def rows(self, n: int) -> torch.Tensor:
        """The first n rows, fp32 [n, H] (what `model_identity` fingerprints)."""
        return self.source.rows(self.name, torch.arange(min(n, self.num_embeddings)))

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, fp32 [V, H], dequantized once per source (for tools that want a stock-like table: the
        direct path and the feature head read rows, `forward`)."""
        tables = self.source.__dict__.setdefault("_tables", {})
        if self.name not in tables:
            tables[self.name] = self.source.linear(self.name).dequantize()
        return tables[self.name]


class GGUFModel(torch.nn.Module):
    """A GGUF target on the static path (see the module docstring). `layers`: keep only the first N decoder
    layers (a `self:layers=N` draft sharing the target's packed weights)."""

    def __init__(self, source: GGUFWeights, generation_config, layers: int | None = None):
        super().__init__()
        self.weight_source = source
        self.config = copy.deepcopy(source.config)
        if layers is not None:
            self.config.num_hidden_layers = layers
            if isinstance(getattr(self.config, "layer_types", None), list):
                self.config.layer_types = self.config.layer_types[:layers]
        self.config._attn_implementation = "sdpa"  # what the stock module is loaded with (`stock()`)
        self.generation_config = generation_config
        self.embed = RowEmbedding(source, "embed_tokens", source.embed_scale)
        # tied: the embedding's packed weight (and whole table, when built), never its scale
        self.head = RowEmbedding(source, "embed_tokens" if source.tied else "lm_head")
        self.rotary = rotary_embedding(self.config)
        # One empty placeholder per decoder layer, so that code which counts the layers (`decoder_layers`, skip
        # sets) finds them; the weights themselves are in `weight_source`.
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(self.config.num_hidden_layers))
        self._stock: torch.nn.Module | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the products' activations and outputs (the weights stay the file's blocks)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get_input_embeddings(self) -> RowEmbedding:
        return self.embed

    def get_output_embeddings(self) -> RowEmbedding:
        return self.head

    def truncated(self, layers: int) -> "GGUFModel":
        """The first `layers` layers, final norm and head, on the same source (nothing packed twice)."""
        return GGUFModel(self.weight_source, self.generation_config, layers)

    def stock(self) -> torch.nn.Module:
        """The stock transformers module of these weights (fp32, from the cached conversion), built once."""
        if self._stock is None:
            from transformers import AutoModelForCausalLM

            from draftverify.loading.gguf import gguf_to_folder

            folder = gguf_to_folder(self.weight_source.path)
            n = self.config.num_hidden_layers
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, local_files_only=True, attn_implementation="sdpa", num_hidden_layers=n
            )
            self._stock = model.eval().requires_grad_(False)
        return self._stock


LLAMA_ROTARY = ("llama", "mistral", "qwen2", "qwen3")  # transformers' rotary module of these is one code (Llama's)
FIXED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # frequencies fixed at init (no per-forward update)


def rotary_embedding(config) -> torch.nn.Module:
    """The architecture's rotary embedding: `RotaryEmbedding` where it is transformers' Llama code with fixed
    frequencies, else the architecture's own module (transformers'), built from the config alone."""
    if config.model_type in LLAMA_ROTARY and config.rope_parameters.get("rope_type", "default") in FIXED_ROPE_TYPES:
        return RotaryEmbedding(config)
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    config = transformers_config(config)
    kind = model_type_to_module_name(config.model_type)  # "gemma3_text" lives in models/gemma3
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    return cls(config=config)


class RotaryEmbedding(torch.nn.Module):
    """transformers' `LlamaRotaryEmbedding` (Qwen2's and Qwen3's are the same code) for a rope type whose frequencies
    are fixed at init, without importing the modeling module (the direct path runs no stock module): the frequencies
    from transformers' own functions and the forward's ops in the same order, so the same bits (tested against it)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        if self.rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq, self.attention_scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:  # transformers' own function of this rope type
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](transformers_config(config))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: only its dtype and device; position_ids [B, T] -> cos, sin [B, T, head_dim]."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
