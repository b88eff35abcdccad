"""An architecture as a recipe: where its modules are and how its layers differ, as data.

The static decoder (`backend.decoder`) runs one layer shape: RMSNorm -> attention (q/k/v/o, optional bias,
optional per-head q/k norm, grouped-query, the model's own rotary embedding, optional logit soft-capping)
-> [RMSNorm] -> residual add -> RMSNorm -> gated MLP -> [RMSNorm] -> residual add. What differs between
architectures is written here, one `Recipe` per `model_type`, and read by the decoder: module names, whether
q/k/v (or gate/up) arrive fused in one linear (Phi-3), per-head q/k norms (Qwen3, Gemma 3), the sandwich
norms after attention and MLP (Gemma), an RMSNorm weight offset (Gemma: x * (1 + w)), the MLP's activation,
rotary tables per layer type (Gemma 3's local and global bases) and logit soft-capping (Gemma 2's attention,
Gemma's final logits; the caps are read from the config). Embedding scaling (Gemma) needs no field: the
decoder calls the stock embedding module, which scales; nor do tied embeddings: the LM head is read from the
model's output embeddings, tied or not. A new architecture whose layers have this shape is a new row of
`RECIPES`; what the decoder does not implement is refused by `unsupported_reason` in one line, so a recipe
never silently runs the wrong arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP activations the decoder implements (ops.gated)


@dataclass(frozen=True)
class Recipe:
    """How one architecture's decoder reads (see the module docstring)."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: q|k|v already fused (Phi-3's qkv_proj)
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one name: gate|up already fused (Phi-3's gate_up_proj)
    out: str = "o_proj"
    down: str = "down_proj"
    norm_in: str = "input_layernorm"  # before attention
    norm_mlp: str = "post_attention_layernorm"  # before the MLP
    norm_attn_out: str | None = None  # on the attention's output, before the residual add (Gemma)
    norm_mlp_out: str | None = None  # on the MLP's output, before the residual add (Gemma)
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation (`q_norm`, `k_norm`)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight), in fp32 before rounding (Gemma: 1)
    rope_per_type: bool = False  # the rotary module takes the layer type (Gemma 3: local and global bases)
    attn_softcap: bool = False  # attention scores soft-capped by config.attn_logit_softcapping (Gemma 2)
    final_softcap: bool = False  # logits soft-capped by config.final_logit_softcapping when set (Gemma)

    @property
    def llama_shaped(self) -> bool:
        """Whether a layer is the plain pre-norm Llama layer (what the kernels' one-call `layer` computes)."""
        return not (self.qk_norm or self.norm_attn_out or self.norm_mlp_out or self.norm_offset or self.attn_softcap)

    def one_call(self, config) -> bool:
        """Whether a few rows of a layer may go through the kernels' one-call layer: a plain pre-norm SiLU layer."""
        return self.llama_shaped and activation(config) == "silu"


_GEMMA = dict(
    norm_mlp="pre_feedforward_layernorm",
    norm_attn_out="post_attention_layernorm",
    norm_mlp_out="post_feedforward_layernorm",
    norm_offset=1.0,
    final_softcap=True,
)
RECIPES: dict[str, Recipe] = {
    "llama": Recipe(),  # SmolLM2 too
    "mistral": Recipe(),
    "qwen2": Recipe(),  # q/k/v biases: read from the modules
    "qwen3": Recipe(qk_norm=True),
    "gemma2": Recipe(attn_softcap=True, **_GEMMA),
    "gemma3_text": Recipe(qk_norm=True, rope_per_type=True, **_GEMMA),
    "phi3": Recipe(qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
}
SUPPORTED_TYPES = tuple(RECIPES)
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # frequencies chosen by the forward's longest position


def unsupported_layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None) or []
    return sorted(set(types) - {"full_attention", "sliding_attention"})


def activation(config) -> str:
    """The gated MLP's activation as the config names it (Gemma: `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the static path cannot run `model` (None when it can), in one line."""
    cfg = model.config
    recipe = RECIPES.get(cfg.model_type)
    if recipe is None:
        return f"the static path supports {', '.join(SUPPORTED_TYPES)}, not {cfg.model_type!r}"
    if unsupported_layer_types(cfg):
        return f"layer types {unsupported_layer_types(cfg)} are not supported by the static path"
    if activation(cfg) not in ACTIVATIONS:
        return f"activation {activation(cfg)!r} is not supported by the static path"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention is not supported by the static path (it decodes causally)"
    reason = _rope_reason(cfg)
    if reason is not None:
        return reason
    if getattr(model, "weight_source", None) is not None:  # read from a file by logical names (loading.gguf_model)
        return None
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or model.get_output_embeddings() is None:
        return f"{type(model).__name__} does not have the Llama-style module layout"
    return _layer_reason(inner.layers[0], recipe)


def _rope_reason(cfg) -> str | None:
    """Why the model's rotary embedding cannot run on the static path, or None."""
    params = getattr(cfg, "rope_parameters", None) or {}
    per_type = params.values() if all(isinstance(p, dict) for p in params.values()) and params else [params]
    for p in per_type:
        kind = (p or {}).get("rope_type", "default")
        if kind in _POSITION_DEPENDENT_ROPE:
            return (
                f"rope type {kind!r} picks its frequencies by the longest position in a forward, so a verified "
                "token would not rotate as its own step does: the static path does not support it"
            )
        if float((p or {}).get("partial_rotary_factor", 1.0)) != 1.0:
            return "partial rotary embeddings (partial_rotary_factor < 1) are not supported by the static path"
    return None


def _layer_reason(layer: torch.nn.Module, recipe: Recipe) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, p) for p in (*recipe.qkv, recipe.out)):
        return f"{type(layer).__name__} does not have the Llama-style attention"
    if not all(hasattr(mlp, p) for p in (*recipe.gate_up, recipe.down)):
        return f"{type(layer).__name__} does not have a gated MLP"
    norms = (recipe.norm_in, recipe.norm_mlp, recipe.norm_attn_out, recipe.norm_mlp_out)
    if not all(hasattr(layer, name) for name in norms if name is not None):
        return f"{type(layer).__name__} does not have the norms its recipe names"
    if recipe.qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
        return f"{type(layer).__name__} does not have per-head q/k norms"
    biases = (getattr(getattr(attn, recipe.out), "bias", None), getattr(getattr(mlp, recipe.down), "bias", None))
    if any(b is not None for b in biases):
        return "output-projection biases are not supported by the static path"
    return None
