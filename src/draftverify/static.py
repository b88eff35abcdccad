"""The fast forward path: a Llama-family decoder over a static KV cache with prepacked weights.

`Runner(model, backend="static")` uses this instead of calling the stock transformers model.
It reads the stock model's own modules (no copy of its code, no change to the model) and runs
the same arithmetic with three changes that matter on a CPU:

- **Prepacked, fused linears.** q/k/v become one matmul and gate/up another; on a CPU each
  weight is reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._linear_pointwise`,
  what inductor emits for a frozen fp32 linear), whose time barely grows from 1 to 16 rows,
  where eager `F.linear` doubles: verifying a draft costs little more than one step, with no
  compile step. One row (autoregressive decoding, drafting) of plain fp32 weights goes to our
  own kernel (kernels/cpu.cpp), which streams them faster still; two rows are padded to three,
  which oneDNN multiplies faster. docs/backends.md has the measured curves.
- **Quantized weights, read exactly.** A weight that is exactly Q4_1 / Q8_0 blocks (a GGUF model
  such as the default one, loaded as the blocks dequantized to fp32) keeps those blocks too, and
  forwards over at most `QUANT_ROWS` tokens (decoding, drafting, verification; not prefill)
  multiply with them (kernels/quant.py, cpu.cpp): the same fp32 weights rebuilt in registers, a
  fifth of the bytes to stream per decoding step, and each row's sums formed the same way for any
  row count, so a verified token's logits are bit for bit those of a one-token step.
- **A static KV cache.** One preallocated buffer per layer, written by slot; `crop` only moves
  the length, `select` gathers the accepted tree slots in place; capacity doubles when full.
- **Explicit masks and positions.** Every forward builds its boolean mask from the tree mask
  and the per-layer sliding window (key positions are known: slot i of the committed prefix
  holds position i), so full, sliding and mixed layers all take the same path. Attention is
  our kernel (cpu.cpp), each token's row computed alone: one call up to `QUANT_ROWS` new
  tokens, `PREFILL_ROWS` query rows a call for a prefill (in fp32 on a CPU: SDPA with the
  boolean mask took 2.4 times as long on a 769-token prompt, 0.39 of that prefill; SDPA elsewhere).
- **One call per layer.** A forward of one sequence over at most `QUANT_ROWS` tokens whose layer
  has only quantized products runs that layer in one kernel call (cpu.cpp `layer`: norm, q/k/v,
  rotary + attention, o, norm, gate/up, SiLU, down), the same kernels in the same order as the
  op-by-op layer, so the same bits; it saves the dispatch of about a dozen small ops a layer.
  SiLU(gate) * up is our kernel on every path (`silu_mul`), so stacked (batched) forwards,
  which run the layers op by op, still give each sequence its own bits.

This is the one place where draftverify runs a decoder loop of its own instead of the stock
class (as gpt-fast does): the stock forward allocates per step and pays framework overhead that
hides the flat matmul curve. It reads the stock modules' weights and rotary embedding, and
tests/test_backends.py checks it against the stock model's own full-sequence forward for every
supported architecture, so a transformers change that moves the arithmetic shows up there.

Supported: decoders whose layers are pre-norm RMSNorm -> attention (q/k/v/o, optional bias,
optional per-head q/k norm, grouped-query) -> RMSNorm -> gated SiLU MLP, with the model's own
rotary embedding: Llama, Mistral, Qwen2, Qwen3 (and SmolLM2, a Llama). Anything else runs on
the stock model (`backend="eager"`); `unsupported_reason` says why in one line.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_PACK_ROWS = 32  # oneDNN packing hint; one packing serves every row count (measured flat 1..32)
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # head sizes the attention kernel (cpu.cpp) takes
# A prefill's query rows per call of the attention kernel: a call's partial sums grow with its rows times
# their key chunks. Measured on SmolLM2's shapes (9 heads over 3 kv heads of 64, 2-core Zen 5), a 769-token
# prompt's 30 layers: 98 ms in calls of 128 rows, 102 of 32, 126 in one call; SDPA with the mask 237, with
# is_causal 171 (which cannot take a cached prefix, a tree or a window).
PREFILL_ROWS = 128
QUANT_ROWS = (
    32  # up to this many rows, exactly quantized weights go to the quantized product (measured: docs/backends.md)
)


def layer_windows(config) -> list[int | None]:
    """The sliding window of each decoder layer (None = full attention), as transformers reads the config."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        return [window if t == "sliding_attention" else None for t in types[:n]]
    return [window] * n  # e.g. Mistral: one window for every layer, or None


def window_masks(positions: torch.Tensor, tree_mask: torch.Tensor | None, past: int, windows) -> dict:
    """Boolean [n, past + n] masks (True = may attend), one per distinct window in `windows` (None =
    full attention). New token i at `positions[i]` attends the cached prefix (slot j holds position j)
    and the new tokens `tree_mask` [n, n] allows (causal when None), and only keys less than the
    window behind it. The static path and the eager one both mask with these."""
    n, device = positions.shape[0], positions.device
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device)
    if tree_mask is not None:
        allowed[:, past:] = tree_mask.to(device, torch.bool)
    elif n > 1:
        allowed[:, past:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    key_pos = torch.cat([torch.arange(past, device=device), positions])  # [past + n]
    return {
        w: allowed if w is None else allowed & (positions.view(n, 1) - key_pos.view(1, -1) < w) for w in set(windows)
    }


def unsupported_layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None) or []
    return sorted(set(types) - {"full_attention", "sliding_attention"})


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the static path cannot run `model` (None when it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"the static path supports {', '.join(SUPPORTED_TYPES)}, not {cfg.model_type!r}"
    if unsupported_layer_types(cfg):
        return f"layer types {unsupported_layer_types(cfg)} are not supported by the static path"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not supported by the static path"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or model.get_output_embeddings() is None:
        return f"{type(model).__name__} does not have the Llama-style module layout"
    layer = inner.layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return f"{type(layer).__name__} does not have the Llama-style attention"
    if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        return f"{type(layer).__name__} does not have a gated MLP"
    if not hasattr(layer, "input_layernorm") or not hasattr(layer, "post_attention_layernorm"):
        return f"{type(layer).__name__} is not a pre-norm layer"
    if getattr(attn.o_proj, "bias", None) is not None or getattr(mlp.down_proj, "bias", None) is not None:
        return "output-projection biases are not supported by the static path"
    return None


_PACKED: "weakref.WeakValueDictionary[tuple, PackedLinear]" = weakref.WeakValueDictionary()


def packed_linear(linears: list[torch.nn.Linear], draft: bool = False) -> "PackedLinear":
    """The PackedLinear of these stock linears, shared by every runner of the same weights (`draft`: see
    PackedLinear).

    A live PackedLinear belongs to a decoder that holds its model, so the weights' addresses
    in the key cannot be reused while the entry exists.
    """
    key = (
        draft,
        *(
            (lin.weight.data_ptr(), tuple(lin.weight.shape), lin.weight.dtype, str(lin.weight.device))
            for lin in linears
        ),
    )
    found = _PACKED.get(key)
    if found is None:
        found = _PACKED[key] = PackedLinear(linears, draft)
    return found


class PackedLinear:
    """y = x W^T + b for several stock linears fused along the output dimension, prepacked on CPU.

    `draft`: a draft's weight gets a rounded copy (`quant_blocks`): int8 rows, multiplied by int8 dot
    products at any row count where the CPU has AVX-512 VNNI (`kernels.quant.i8_rows`), else Q8_0 blocks
    for few-row forwards (`q8_blocks`); a quarter of the bytes to stream, and with VNNI a quarter of the
    instructions: a draft's precision changes what it proposes, never what verification accepts."""

    def __init__(self, linears: list[torch.nn.Linear], draft: bool = False):
        weight = torch.cat([lin.weight.detach() for lin in linears])  # [out, in]
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [
                    b.detach()
                    if b is not None
                    else torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
                    for b, lin in zip(biases, linears)
                ]
            )
        else:
            self.bias = None
        self.packed = packable(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS) if self.packed else weight
        self.out_features = weight.shape[0]
        # Few rows of a weight that is exactly Q4_1 / Q8_0 blocks (a GGUF model) go to the quantized
        # product: the same fp32 weights, read at 5 or 8.5 bits each (kernels/quant.py).
        self.blocks = quant_blocks(weight, draft)
        self._no_bias = torch.empty(0, dtype=weight.dtype, device=weight.device)
        b = self.blocks  # the quantized product's arguments, as `quant_linear` and the one-call `layer` take them
        self.quant = None if b is None else [b.q, b.d, b.m, self.bias if self.bias is not None else self._no_bias]
        # One row (autoregressive decoding, drafting) of a weight without blocks goes to our own kernel
        # when it is built: it streams the plain fp32 weight faster than oneDNN (kernels/cpu.cpp). A weight
        # with blocks takes the quantized product for one row, so it keeps no second plain copy.
        self.kernel = one_row_kernel(weight) if self.blocks is None else None
        self.dense = weight.contiguous() if self.kernel is not None else None

    def __call__(self, x: torch.Tensor, quant: bool = False) -> torch.Tensor:  # [m, in] -> [m, out]
        """`quant`: the quantized product (if the weight has blocks) whatever the number of rows (a draft's int8
        rows take it at any row count: their product beats oneDNN's fp32 one at every size)."""
        if self.quant is not None and (quant or x.shape[0] <= QUANT_ROWS or self.blocks.kind == "i8_rows"):
            return _kernels[0].quant_linear(x.contiguous(), *self.quant)
        if self.kernel is not None and x.shape[0] == 1:
            return self.kernel.linear(x.contiguous(), self.dense, self.bias if self.bias is not None else self._no_bias)
        if self.packed:
            if x.shape[0] == 2:  # oneDNN's AVX2 kernel takes longer for 2 rows than for 3 (~25%)
                return self._onednn(torch.cat([x, x[1:]]))[:2]
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Spans:
    """The rows of a stacked forward, (first row, count) per sequence in order, and how a linear takes them:
    each sequence's rows on the product its own forward would use, so stacking changes no row's arithmetic.
    The quantized product is row-invariant and takes every short sequence's rows in one call; oneDNN, whose
    sums may depend on the row count, takes each long sequence's rows (a prefill) alone."""

    def __init__(self, spans: list[tuple[int, int]], device):
        self.single = len(spans) == 1
        self.long = [(a, n) for a, n in spans if n > QUANT_ROWS]
        short = [(a, n) for a, n in spans if n <= QUANT_ROWS]
        self.short = (
            None
            if self.single or not short or not self.long
            else torch.cat([torch.arange(a, a + n, device=device) for a, n in short])
        )

    def __call__(self, linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        if self.single or linear.blocks is None:  # one sequence; or no quantized product (oneDNN throughout)
            return linear(x)
        if not self.long:
            return linear(x, quant=True)
        out = x.new_empty(x.shape[0], linear.out_features)
        if self.short is not None:
            out[self.short] = linear(x[self.short], quant=True)
        for a, n in self.long:
            out[a : a + n] = linear(x[a : a + n])
        return out


def quant_blocks(weight: torch.Tensor, draft: bool = False):
    """The exact Q4_1 / Q8_0 blocks of `weight` when the compiled kernels can multiply them (else None); for a
    draft, its int8 rows where the kernels have int8 dot products, else its Q8_0 rounding."""
    kernels = cpu_kernels()
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or kernels is None:
        return None
    from draftverify.kernels.quant import exact_blocks, i8_rows, q8_blocks

    if not draft:
        return exact_blocks(weight)
    return (i8_rows(weight) if kernels.int8_rows() else None) or q8_blocks(weight)


def one_row_kernel(weight: torch.Tensor):
    """The compiled kernels if their one-row product serves this weight: fp32 on a CPU, in-features a
    multiple of 32 (it streams fp32 weights faster than oneDNN's one-row product: docs/backends.md)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[1] % 32:
        return None
    return cpu_kernels()


_kernels: list = []  # cpu_kernels()'s answer, once asked (it sits on every linear and norm of a forward)


def cpu_kernels():
    """kernels/cpu.cpp compiled (None where it cannot be: kernels.unavailable() says why)."""
    if not _kernels:
        from draftverify.kernels import cpu

        _kernels.append(cpu())
    return _kernels[0]


def packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype (one fused op in fp32,
    where both orders of rounding agree; our one-pass kernel on a CPU)."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        kernels = cpu_kernels() if x.device.type == "cpu" and x.is_contiguous() else None
        if kernels is not None:
            return kernels.rms_norm(x, weight, eps)
        return torch.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gated MLP's [m, 2 I] gate | up product: our kernel on a CPU in fp32 (which the fused
    layer uses too, so every path forms each element alike), else ATen's."""
    kernels = cpu_kernels() if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" else None
    if kernels is not None:
        return kernels.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_weights(qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear) -> list | None:
    """A layer's products as the kernels' one-call `layer` takes them, or None unless every one is quantized."""
    weights = [lin.quant for lin in (qkv, o, gate_up, down)]
    return weights if all(w is not None for w in weights) else None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """One decoder layer's weights, read from the stock module."""

    def __init__(self, layer: torch.nn.Module, eps: float, draft: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = packed_linear([attn.q_proj, attn.k_proj, attn.v_proj], draft)
        self.o = packed_linear([attn.o_proj], draft)
        self.gate_up = packed_linear([mlp.gate_proj, mlp.up_proj], draft)
        self.down = packed_linear([mlp.down_proj], draft)
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps = getattr(layer.input_layernorm, "variance_epsilon", eps)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        self.q_norm = None if q_norm is None else (q_norm.weight.detach(), getattr(q_norm, "variance_epsilon", eps))
        self.k_norm = None if k_norm is None else (k_norm.weight.detach(), getattr(k_norm, "variance_epsilon", eps))
        self.scaling = float(getattr(attn, "scaling", attn.head_dim**-0.5))
        # no q/k norms: a few rows may go through the kernels' one-call layer
        self.fused = layer_weights(self.qkv, self.o, self.gate_up, self.down) if self.q_norm is None else None


class StaticDecoder:
    """A stock Llama-family model run over a static KV cache (see the module docstring).

    The cache holds `length` tokens in slots 0..length-1; `forward` writes new tokens at the
    next slots. Same contract as `Runner` (which delegates here). `draft`: the model only drafts
    (its weights may be rounded, `PackedLinear`).
    """

    def __init__(self, model: torch.nn.Module, draft: bool = False):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        cfg = model.config
        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        with torch.no_grad():
            self.layers = [_Layer(layer, eps, draft) for layer in inner.layers[: cfg.num_hidden_layers]]
            self.norm = inner.norm.weight.detach()
            self.norm_eps = getattr(inner.norm, "variance_epsilon", eps)
            self.head = packed_linear([model.get_output_embeddings()], draft)
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.n_heads = self.layers[0].q_size // self.head_dim
        self.n_kv = self.layers[0].kv_size // self.head_dim
        self.windows = layer_windows(cfg)
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_length = getattr(cfg, "max_position_embeddings", None)
        kernels = (
            cpu_kernels()
            if self.device.type == "cpu" and self.dtype == torch.float32 and self.head_dim in ATTENTION_HEAD_DIMS
            else None
        )
        self.attention_kernel = kernels.attention if kernels is not None else None
        self.rope_attention = kernels.rope_attention if kernels is not None else None
        self.layer_kernel = kernels.layer if kernels is not None else None
        self._no_mask = torch.empty(0, dtype=torch.bool)
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [n_kv, capacity, head_dim]
        self.values: list[torch.Tensor] = []

    # -- cache -------------------------------------------------------------------------

    def reset(self) -> None:
        self.length = 0  # the buffers stay allocated for the next sequence

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(256, self.capacity)
        while capacity < needed:
            capacity *= 2
        if self.max_length:
            capacity = max(needed, min(capacity, self.max_length))
        shape = (self.n_kv, capacity, self.head_dim)
        fresh = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * len(self.layers))]
        for old, new in zip(self.keys + self.values, fresh):
            new[:, : self.length].copy_(old[:, : self.length])
        self.keys, self.values = fresh[: len(self.layers)], fresh[len(self.layers) :]
        self.capacity = capacity

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()  # the buffers are inference tensors (made inside `forward`)
    def select(self, keep: int, slots: list[int]) -> None:
        if slots == list(range(keep, keep + len(slots))):
            return self.crop(keep + len(slots))
        index = torch.tensor(slots, device=self.device)
        for buf in self.keys + self.values:  # gather in place: the accepted slots move down to keep..
            buf[:, keep : keep + len(slots)] = buf.index_select(1, index)
        self.length = keep + len(slots)

    # -- forward -----------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        last: int | None,
        hidden: bool | str,
        skip=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed `tokens` [n]; return logits [m, V] for the last m = `last` (all if None), and hidden [m, H]."""
        return self.forward_many([self], [(tokens, positions, tree_mask, last, hidden)], skip)[0]

    @torch.inference_mode()
    def forward_many(self, decoders: list["StaticDecoder"], feeds: list[tuple], skip=None) -> list[tuple]:
        """One forward for several sequences, each with its own cache (a decoder of this model): feed i,
        (tokens [n_i], positions, tree_mask, last, hidden) as in `forward`, goes to `decoders[i]`.

        The rows of every sequence are stacked (no padding), so the linears and the LM head run once
        over all of them (`Spans`: each sequence's rows on the product its own forward would use); only
        attention runs per sequence, against that sequence's own cache, positions and mask.
        """
        assert all(d.model is self.model for d in decoders), "a batched forward needs decoders of one model"
        parts = []  # per sequence: (decoder, first row, n, past, masks)
        rows, all_tokens, all_positions = 0, [], []
        for d, (tokens, positions, tree_mask, last, hidden) in zip(decoders, feeds):
            n, past = tokens.shape[0], d.length
            d._reserve(past + n)
            causal = positions is None and tree_mask is None
            positions = (
                torch.arange(past, past + n, device=self.device) if positions is None else positions.to(self.device)
            )
            parts.append((d, rows, n, past, d._masks(positions, tree_mask, causal, past, n)))
            all_tokens.append(tokens)
            all_positions.append(positions)
            rows += n
        tokens = all_tokens[0] if len(feeds) == 1 else torch.cat(all_tokens)
        positions = all_positions[0] if len(feeds) == 1 else torch.cat(all_positions)
        cos, sin = self.rotary(self.embed.weight[:1].unsqueeze(0), positions.view(1, rows))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [rows, 1, head_dim]
        h = self.embed(tokens)  # [rows, H]
        skip_attn = set(skip.attention) if skip is not None else ()
        skip_mlp = set(skip.mlp) if skip is not None else ()
        spans = Spans([(a, n) for _, a, n, _, _ in parts], self.device)
        # one short sequence: each layer with nothing skipped in one kernel call (`layer`: the same kernels as below)
        one = parts[0] if len(parts) == 1 and parts[0][2] <= QUANT_ROWS and self.layer_kernel is not None else None
        rows = (cos[:, 0], sin[:, 0]) if one is not None else None  # [rows, head_dim]: the kernels' layout
        for i, layer in enumerate(self.layers):
            if one is not None and layer.fused is not None and i not in skip_attn and i not in skip_mlp:
                d, _, _, past, masks = one
                mask = masks[self.windows[i]]
                h = self.layer_kernel(
                    h,
                    layer.norm_in,
                    layer.norm_post,
                    layer.eps,
                    *layer.fused,
                    *rows,
                    d.keys[i],
                    d.values[i],
                    past,
                    self.n_heads,
                    self._no_mask if mask is None else mask,
                    layer.scaling,
                )
                continue
            if i not in skip_attn:
                h = h + self._attention(i, layer, h, cos, sin, parts, spans)
            if i not in skip_mlp:
                h = h + spans(layer.down, silu_mul(spans(layer.gate_up, rms_norm(h, layer.norm_post, layer.eps))))
        out_rows, state_rows = [], []  # per sequence: the rows that get logits, the rows whose states return
        for (d, a, n, past, _), (_, _, _, last, hidden) in zip(parts, feeds):
            d.length = past + n
            m = last or n
            out_rows.append((a + n - m, m))
            state_rows.append((a, n) if hidden == "all" else (a + n - m, m) if hidden else None)
        if len(feeds) == 1 and state_rows[0] in (None, out_rows[0]):  # normalise only the rows that need logits
            b, m = out_rows[0]
            states = rms_norm(h[b : b + m], self.norm, self.norm_eps)
            return [(self.head(states), states if state_rows[0] else None)]
        states = rms_norm(h, self.norm, self.norm_eps)
        if len(feeds) == 1:
            b, m = out_rows[0]
            logits = [self.head(states[b : b + m])]
        else:
            index = torch.cat([torch.arange(b, b + m, device=self.device) for b, m in out_rows])
            starts = [0, *itertools.accumulate(m for _, m in out_rows)]
            logits = Spans(list(zip(starts, (m for _, m in out_rows))), self.device)(self.head, states[index]).split(
                [m for _, m in out_rows]
            )
        return [(logit, None if s is None else states[s[0] : s[0] + s[1]]) for logit, s in zip(logits, state_rows)]

    def _attention(self, i, layer: _Layer, h, cos, sin, parts, spans: Spans) -> torch.Tensor:
        x = rms_norm(h, layer.norm_in, layer.eps)
        qkv = spans(layer.qkv, x)
        fused = self.rope_attention is not None and layer.q_norm is None
        outs = []
        for dec, a, n, past, masks in parts:  # each sequence against its own cache, the way its forward alone goes
            mask = masks[self.windows[i]]
            keys, values = dec.keys[i], dec.values[i]
            if fused and n <= QUANT_ROWS:  # one kernel call: rotate q and k, store k and v, attend (cpu.cpp)
                outs.append(
                    self.rope_attention(
                        qkv[a : a + n],
                        cos[a : a + n, 0],
                        sin[a : a + n, 0],
                        keys,
                        values,
                        past,
                        self.n_heads,
                        self._no_mask if mask is None else mask,
                        layer.scaling,
                    )
                )
                continue
            q, k, v = self._rotated(layer, qkv[a : a + n], cos[a : a + n], sin[a : a + n])
            keys[:, past : past + n] = k.transpose(0, 1)
            values[:, past : past + n] = v.transpose(0, 1)
            if self.attention_kernel is not None and n <= QUANT_ROWS:  # few queries (Qwen3's normed q and k): one call
                outs.append(
                    self.attention_kernel(
                        q, keys, values, past + n, self._no_mask if mask is None else mask, layer.scaling
                    )
                )
                continue
            if self.attention_kernel is not None:  # a prefill (n > 1, so a mask): PREFILL_ROWS query rows a call
                outs.append(
                    torch.cat(
                        [
                            self.attention_kernel(
                                q[r : r + PREFILL_ROWS],
                                keys,
                                values,
                                past + n,
                                mask[r : r + PREFILL_ROWS],
                                layer.scaling,
                            )
                            for r in range(0, n, PREFILL_ROWS)
                        ]
                    )
                )
                continue
            if n == 1 and mask is None:  # one query, every key: three small ops beat SDPA's CPU kernel
                groups = q[0].view(
                    self.n_kv, self.n_heads // self.n_kv, self.head_dim
                )  # query head h reads kv head h // group
                scores = torch.bmm(groups, keys[:, : past + 1].transpose(1, 2)).mul_(layer.scaling)
                out = torch.bmm(scores.softmax(-1, dtype=torch.float32).to(q.dtype), values[:, : past + 1])
                outs.append(out.view(1, self.n_heads * self.head_dim))
                continue
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),  # [1, heads, n, d]
                keys[:, : past + n].unsqueeze(0),  # [1, kv heads, past + n, d]
                values[:, : past + n].unsqueeze(0),
                attn_mask=mask,
                scale=layer.scaling,
                enable_gqa=self.n_heads != self.n_kv,
            )  # [1, heads, n, d]
            outs.append(out[0].transpose(0, 1).reshape(n, self.n_heads * self.head_dim))
        return spans(layer.o, outs[0] if len(outs) == 1 else torch.cat(outs))

    def _rotated(self, layer: _Layer, qkv, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's rows of the fused projection [n, q + k + v] -> q [n, heads, d], k and v [n, kv heads, d],
        q and k rotated."""
        d, n = self.head_dim, qkv.shape[0]
        v = qkv[:, layer.q_size + layer.kv_size :].view(n, self.n_kv, d)
        if layer.q_norm is None:  # rotate q and k together: [n, heads + kv heads, d]
            qk = qkv[:, : layer.q_size + layer.kv_size].view(n, self.n_heads + self.n_kv, d)
            qk = qk * cos + rotate_half(qk) * sin
            return qk[:, : self.n_heads], qk[:, self.n_heads :], v
        q = rms_norm(qkv[:, : layer.q_size].view(n, self.n_heads, d), *layer.q_norm)  # Qwen3: per-head norms first
        k = rms_norm(qkv[:, layer.q_size : layer.q_size + layer.kv_size].view(n, self.n_kv, d), *layer.k_norm)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _masks(self, positions, tree_mask, causal: bool, past: int, n: int) -> dict:
        """`window_masks` per window size; None = attend everything (one causal token within every window)."""
        if causal and n == 1 and all(w is None or past < w for w in set(self.windows)):
            return {w: None for w in set(self.windows)}
        return window_masks(positions, tree_mask, past, self.windows)
