"""An architecture as a recipe: where its modules are and how its layers differ, as data.

The static decoder (`backend.decoder`) runs one layer shape: pre-norm RMSNorm -> attention (q/k/v/o,
optional bias, optional per-head q/k norm, grouped-query, the model's own rotary embedding) -> RMSNorm
-> gated MLP. What differs between architectures is written here, one `Recipe` per `model_type`, and
read by the decoder: module names, whether q/k/v (or gate/up) arrive fused in one linear, per-head q/k
norms, an RMSNorm weight offset, embedding scaling and logit soft-capping (tied embeddings need no
field: the LM head is read from the model's output embeddings, tied or not). A new
architecture whose layers have this shape is a new row of `RECIPES`; the fields the decoder does not
implement yet (offsets, scaling, soft-capping, fused inputs) are refused by `unsupported_reason` until
it does, so a recipe never silently runs the wrong arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recipe:
    """How one architecture's decoder reads (see the module docstring)."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: q|k|v already fused (Phi-3's qkv_proj)
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one name: gate|up already fused (Phi-3's gate_up_proj)
    out: str = "o_proj"
    down: str = "down_proj"
    norm_in: str = "input_layernorm"
    norm_post: str = "post_attention_layernorm"
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation (Qwen3: `q_norm`, `k_norm`)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight) (Gemma: 1)
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden size) (Gemma)
    activation: str = "silu"  # the gated MLP's activation
    softcap: bool = False  # attention / final logits soft-capped (Gemma 2)

    @property
    def implemented(self) -> bool:
        """Whether the static decoder implements every field of this recipe as set."""
        return (
            len(self.qkv) == 3
            and len(self.gate_up) == 2
            and self.norm_offset == 0.0
            and not self.embed_scale
            and self.activation == "silu"
            and not self.softcap
        )


RECIPES: dict[str, Recipe] = {
    "llama": Recipe(),  # SmolLM2 too
    "mistral": Recipe(),
    "qwen2": Recipe(),  # q/k/v biases: read from the modules
    "qwen3": Recipe(qk_norm=True),
}
SUPPORTED_TYPES = tuple(RECIPES)


def unsupported_layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None) or []
    return sorted(set(types) - {"full_attention", "sliding_attention"})


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the static path cannot run `model` (None when it can), in one line."""
    cfg = model.config
    recipe = RECIPES.get(cfg.model_type)
    if recipe is None or not recipe.implemented:
        return f"the static path supports {', '.join(SUPPORTED_TYPES)}, not {cfg.model_type!r}"
    if unsupported_layer_types(cfg):
        return f"layer types {unsupported_layer_types(cfg)} are not supported by the static path"
    if getattr(cfg, "hidden_act", "silu") != recipe.activation:
        return f"activation {cfg.hidden_act!r} is not supported by the static path"
    if getattr(model, "weight_source", None) is not None:  # read from a file by logical names (loading.gguf_model)
        return None
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or model.get_output_embeddings() is None:
        return f"{type(model).__name__} does not have the Llama-style module layout"
    return _layer_reason(inner.layers[0], recipe)


def _layer_reason(layer: torch.nn.Module, recipe: Recipe) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, p) for p in (*recipe.qkv, recipe.out)):
        return f"{type(layer).__name__} does not have the Llama-style attention"
    if not all(hasattr(mlp, p) for p in (*recipe.gate_up, recipe.down)):
        return f"{type(layer).__name__} does not have a gated MLP"
    if not hasattr(layer, recipe.norm_in) or not hasattr(layer, recipe.norm_post):
        return f"{type(layer).__name__} is not a pre-norm layer"
    biases = (getattr(getattr(attn, recipe.out), "bias", None), getattr(getattr(mlp, recipe.down), "bias", None))
    if any(b is not None for b in biases):
        return "output-projection biases are not supported by the static path"
    return None
