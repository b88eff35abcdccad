"""The fast forward path: a decoder of the Llama shape (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3: the
differences are data, backend/recipe.py) over a static KV cache with prepacked weights.

`models.Runner(model, backend="static")` runs this instead of the stock transformers model. It reads
the stock model's own modules (no copy of its code, no change to the model), as its architecture's
`Recipe` (backend/recipe.py) says, and runs the same arithmetic with four changes that matter on a CPU:

- **Prepacked, fused linears** (backend/linear.py): q/k/v become one product and gate/up another,
  each weight prepared once for the product that serves it; exactly quantized weights (a GGUF model)
  are multiplied in their blocks, row-invariantly.
- **A static KV cache** (backend/cache.py `StaticCache`): preallocated buffers written by slot; `crop`
  only moves the length, `select` gathers the accepted tree slots in place.
- **Explicit masks and positions**: every forward builds its boolean mask from the tree mask and the
  per-layer sliding window, so full, sliding and mixed layers take the same path; attention is our
  kernel, each token's row computed alone (backend/attention.py).
- **One call per layer**: a forward of one sequence over at most `QUANT_ROWS` tokens whose layer has
  only quantized products runs that layer in one kernel call (kernels/csrc/layer.cpp `layer`), the same kernels in the
  same order as the op-by-op layer, so the same bits; where every layer is one of q8 products, every layer in one
  call (`LayerStack`, kernels/csrc/region.cpp). SiLU(gate) * up is our kernel on every path, so
  stacked (batched) forwards, which run the layers op by op, still give each sequence its own bits.

This is the one place where draftverify runs a decoder loop of its own instead of the stock class (as
gpt-fast does): the stock forward allocates per step and pays framework overhead that hides the flat
matmul curve (docs/backends.md). tests/test_backends.py checks it against the stock model's own
full-sequence forward for every architecture in `RECIPES`, so a transformers change that moves the
arithmetic shows up there. Anything else runs on the stock model (`backend.eager`).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Protocol

import torch

from draftverify.backend.attention import Part, attend
from draftverify.backend.cache import StaticCache
from draftverify.backend.feed import Feed, Forward
from draftverify.backend.linear import QUANT_ROWS, BlockLinear, PackedLinear, Packs, layer_weights, q8_runs
from draftverify.backend.ops import cpu_kernels, layer_windows, rms_norm, run_layer, softcap, vocab_logits, window_masks
from draftverify.backend.recipe import RECIPES, Recipe, activation, unsupported_reason
from draftverify.backend.source import source_layer, source_norm
from draftverify.backend.spans import Spans

# head sizes the attention kernel (attention.cpp) takes (Gemma's 256 included); others attend with SDPA
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)
ROPE_TABLE_MIN = 1024  # positions a rotary table covers at first (`StaticDecoder.rope_tables`)


class LayerWeights:
    """One decoder layer's weights, read from the stock module as its recipe says."""

    def __init__(self, layer: torch.nn.Module, recipe: Recipe, cfg, eps: float, draft: bool, packs: Packs):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = packs.linear([getattr(attn, name) for name in recipe.qkv], draft)  # one name: already fused
        self.o = packs.linear([getattr(attn, recipe.out)], draft)
        self.gate_up = packs.linear([getattr(mlp, name) for name in recipe.gate_up], draft)
        self.down = packs.linear([getattr(mlp, recipe.down)], draft)
        self.q_size = cfg.num_attention_heads * attn.head_dim
        self.kv_size = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv_size *= attn.head_dim
        offset = recipe.norm_offset
        self.norm_in, self.eps = norm_weight(getattr(layer, recipe.norm_in), offset), _eps(layer, recipe.norm_in, eps)
        self.norm_mlp = norm_weight(getattr(layer, recipe.norm_mlp), offset)
        # Gemma's sandwich norms: on the attention's and the MLP's outputs, (weight, eps) or None
        self.norm_attn_out, self.norm_mlp_out = (
            None if name is None else (norm_weight(getattr(layer, name), offset), _eps(layer, name, eps))
            for name in (recipe.norm_attn_out, recipe.norm_mlp_out)
        )
        self.q_norm = self.k_norm = None  # per-head norms of q and k (Qwen3, Gemma 3), (weight, eps)
        if recipe.qk_norm:
            self.q_norm = (norm_weight(attn.q_norm, offset), _eps(attn, "q_norm", eps))
            self.k_norm = (norm_weight(attn.k_norm, offset), _eps(attn, "k_norm", eps))
        self.scaling = float(getattr(attn, "scaling", attn.head_dim**-0.5))  # Gemma: query_pre_attn_scalar ** -0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None) if recipe.attn_softcap else None
        self.activation = activation(cfg)
        self.fused = layer_weights(self.qkv, self.o, self.gate_up, self.down) if recipe.one_call(cfg) else None


def norm_weight(norm: torch.nn.Module, offset: float) -> torch.Tensor:
    """An RMSNorm's scale as `ops.rms_norm` takes it: the weight, or Gemma's offset + weight formed in fp32 (as
    transformers' Gemma RMSNorm forms it)."""
    weight = norm.weight.detach()
    return weight if not offset else offset + weight.float()


def _eps(owner: torch.nn.Module, name: str, default: float) -> float:
    norm = getattr(owner, name)
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", default)))


class DecoderParts(Protocol):
    """What another forward over a `StaticDecoder`'s weights (backend/graphed.py's `GraphedDecoder`) reads of it:
    nothing else of the decoder is an interface. A layer runs op by op as `ops.run_layer` runs it."""

    layers: list[LayerWeights]  # the decoder layers' weights, in order
    embed: torch.nn.Module  # the stock embedding module (Gemma's scaling included)
    n_heads: int
    n_kv: int  # key-value heads; query head h reads kv head h // (n_heads // n_kv)
    head_dim: int
    windows: list  # per layer its sliding window (None: full attention)
    rope_keys: list  # per layer its rotary key (None, or Gemma 3's layer type)
    rope_fixed: bool  # the rotary frequencies never change (`rope_tables` then holds every position's values)
    device: torch.device
    dtype: torch.dtype  # the weights' and the hidden states'
    kv_dtype: torch.dtype  # the cache's
    max_length: int | None  # the model's positions

    def rope_tables(self, count: int) -> dict: ...

    def final_states(self, h: torch.Tensor) -> torch.Tensor: ...

    def logits(self, states: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor: ...


class StaticDecoder:
    """A stock Llama-family model run over static KV caches (see the module docstring). The decoder holds the
    weights; each sequence has a `StaticCache` of its own (`new_cache`). `draft`: the model only drafts (its
    weights may be rounded, `PackedLinear`). `packs`: shares packed weights with other decoders of them."""

    def __init__(self, model: torch.nn.Module, draft: bool = False, packs: Packs | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        cfg = model.config
        recipe, packs = RECIPES[cfg.model_type], packs if packs is not None else Packs()
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        if getattr(model, "weight_source", None) is not None:
            # a GGUF file's blocks (loading.gguf_model), a draft's too in the engine's arithmetic: a draft's arithmetic
            # changes what it proposes, never what verification accepts, and in q8 it shares the target's tiles
            self._from_source(model, recipe, eps, packs.arithmetic)
        else:
            self._from_module(model, recipe, eps, draft, packs)
        self.final_cap = getattr(cfg, "final_logit_softcapping", None) if recipe.final_softcap else None
        self.n_heads = self.layers[0].q_size // self.head_dim
        self.n_kv = self.layers[0].kv_size // self.head_dim
        self.windows = layer_windows(cfg)
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.rope_keys = [t if recipe.rope_per_type else None for t in types[: len(self.layers)]]  # rotary per layer
        self.device, self.dtype = torch.device("cpu"), torch.float32
        if getattr(model, "weight_source", None) is None:  # a stock module: where its weights are (a file's: CPU fp32)
            self.device, self.dtype = self.embed.weight.device, self.embed.weight.dtype
        self.max_length = getattr(cfg, "max_position_embeddings", None)
        fast = self.device.type == "cpu" and self.dtype == torch.float32 and self.head_dim in ATTENTION_HEAD_DIMS
        kernels = cpu_kernels() if fast else None
        self.attention_kernel = kernels.attention if kernels is not None else None
        self.rope_attention = kernels.rope_attention if kernels is not None else None
        self.layer_kernel = kernels.layer if kernels is not None else None
        self.layer_many = kernels.layer_many if kernels is not None else None
        self.stack = self._layer_stack(kernels)
        # the q8 arithmetic keeps keys and values in fp16, rounded as they are stored (as llama.cpp's default f16
        # cache does): every attention reads the rounded values, so a row's bits still do not depend on its forward
        self.kv_dtype = torch.float16 if kernels is not None and not draft and packs.arithmetic == "q8" else self.dtype
        self.no_mask = torch.empty(0, dtype=torch.bool)
        self._vocab_heads: dict[tuple, tuple] = {}  # (ids' address, count) -> (ids, the rows' product) (`_vocab_head`)
        self._rope_probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=self.device)  # the rotary's dtype, device
        # frequencies fixed at init: transformers updates them per forward only for dynamic and longrope types
        kinds = getattr(self.rotary, "rope_type", "default")
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        self.rope_fixed = not any("dynamic" in kind or kind == "longrope" for kind in kinds)
        self._rope_table, self._rope_table_size = {}, 0

    def _from_module(self, model, recipe: Recipe, eps: float, draft: bool, packs: Packs) -> None:
        inner = model.model
        self.model, self.embed, self.rotary = model, inner.embed_tokens, inner.rotary_emb
        with torch.no_grad():
            layers = inner.layers[: model.config.num_hidden_layers]
            self.layers = [LayerWeights(layer, recipe, model.config, eps, draft, packs) for layer in layers]
            self.norm, self.norm_eps = norm_weight(inner.norm, recipe.norm_offset), _eps(inner, "norm", eps)
            self.head = packs.linear([model.get_output_embeddings()], draft)
        self.head_dim = inner.layers[0].self_attn.head_dim

    def _from_source(self, model, recipe: Recipe, eps: float, arithmetic: str = "fp32") -> None:
        """Every product a BlockLinear over the file's blocks (a draft's too: the blocks are the cheap copy)."""
        cfg, source = model.config, model.weight_source
        self.model, self.embed, self.rotary = model, model.get_input_embeddings(), model.rotary
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            self.layers.append(source_layer(source, i, recipe, cfg, eps, arithmetic))
            source.release()  # the layer is packed: its file pages need not stay resident beside the packs
        self.norm, self.norm_eps = source_norm(source, "norm", recipe.norm_offset), eps
        self.head = BlockLinear([source.head(arithmetic)], arithmetic=arithmetic)
        source.packed()  # every weight is packed: the file's pages leave, the packs are cached on disk
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def rows_alone(self) -> bool:
        """Whether each row of a forward gets the bits it would get in any other forward of this decoder: every
        product one product at every row count (`any_rows`: a file's blocks), the kernels' attention (each row
        alone; not Gemma 2's capped scores, which Python forms per forward), norms and rotations per row. A prompt
        may then be fed in parts (`batch.Batch`) and no bit changes."""
        linears = [self.head, *(w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        products = all(linear.any_rows for linear in linears)
        return products and self.rope_attention is not None and all(layer.softcap is None for layer in self.layers)

    def new_cache(self) -> StaticCache:
        return StaticCache(len(self.layers), self.n_kv, self.head_dim, self.kv_dtype, self.device, self.max_length)

    def forward(self, cache: StaticCache, feed: Feed) -> Forward:
        """Feed `feed.tokens` [n] (a tensor on the decoder's device) after `cache`'s tokens."""
        return self.forward_many([cache], [feed])[0]

    @torch.inference_mode()
    def forward_many(self, caches: list[StaticCache], feeds: list[Feed]) -> list[Forward]:
        """One forward for several sequences, each with its own cache: `feeds[i]` goes to `caches[i]`.

        The rows of every sequence are stacked (no padding), so the linears and the LM head run once
        over all of them (`Spans`: each sequence's rows on the product its own forward would use); only
        attention runs per sequence, against that sequence's own cache, positions and mask.
        """
        skip = feeds[0].skip
        parts, tokens, positions = self._stack(caches, feeds)
        ropes = self._ropes(positions)
        h = self.embed(tokens)  # [rows, H] (the stock module: Gemma's scaling included)
        skip_attn = set(skip.attention) if skip is not None else ()
        skip_mlp = set(skip.mlp) if skip is not None else ()
        spans = Spans([(p.first, p.n) for p in parts], self.device)
        # short sequences (one, or a batch's steps and trees): each layer with nothing skipped in one kernel call
        # (`layer` / `layer_many`: the same kernels, on the same rows, as below)
        short = self.layer_kernel is not None and all(p.n <= QUANT_ROWS for p in parts)
        flat = {key: (cos[:, 0], sin[:, 0]) for key, (cos, sin) in ropes.items()} if short else None  # once a forward
        stacked = short and self.stack is not None  # every layer in one call (a draft's skipped sub-layers left out)
        if stacked:
            skips = [(i in skip_attn) | 2 * (i in skip_mlp) for i in range(len(self.layers))] if skip else []
            h = self._stacked_layers(h, *flat[self.rope_keys[0]], parts, skips)
        # A layer runs one of three ways, all with the same bits (test_quantized_forward.py, test_gguf_direct.py and
        # test_q8_engine.py check it): every layer in one call, one call a layer, or op by op (`ops.run_layer`, the
        # graphed decoder's too). The two calls are kept for speed alone: they run the same kernels in the same order
        # without a Python call per op, which is most of a short forward's cost on a CPU.
        for i, layer in enumerate(() if stacked else self.layers):
            if short and layer.fused is not None and i not in skip_attn and i not in skip_mlp:
                h = self._fused_layer(i, layer, h, *flat[self.rope_keys[i]], parts)
                continue
            cos, sin = ropes[self.rope_keys[i]]

            def attention(qkv, i=i, layer=layer, cos=cos, sin=sin):
                outs = [attend(self, i, layer, qkv[p.first : p.first + p.n], *_rows(cos, sin, p), p) for p in parts]
                return outs[0] if len(outs) == 1 else torch.cat(outs)

            h = run_layer(layer, h, attention, spans, i in skip_attn, i in skip_mlp)
        for p in parts:
            p.cache.length = p.past + p.n
        return self._outputs(h, parts, feeds)

    def _ropes(self, positions: torch.Tensor) -> dict:
        """The stock rotary module's cos, sin [rows, 1, head_dim] per rotary key (None, or Gemma 3's layer types).
        On CPU, with frequencies that never change, they are rows of tables the module made once (`rope_tables`):
        the module forms each position's values alone (one product, then cos and sin), so a table's row is what it
        gives that position in any call, and a forward gathers rows instead of paying the module's ops."""
        if self.rope_fixed and positions.device.type == "cpu":
            tables = self.rope_tables(int(positions.max()) + 1)
            return {key: (cos[positions][:, None], sin[positions][:, None]) for key, (cos, sin) in tables.items()}
        return {key: (cos[0].unsqueeze(1), sin[0].unsqueeze(1)) for key, (cos, sin) in self._rotary(positions).items()}

    def _rotary(self, positions: torch.Tensor) -> dict:
        """The rotary module's cos, sin [1, rows, head_dim] of `positions` per rotary key."""
        x, ids = self._rope_probe, positions.view(1, -1)
        return {key: self.rotary(x, ids) if key is None else self.rotary(x, ids, key) for key in set(self.rope_keys)}

    def rope_tables(self, count: int) -> dict:
        """Per rotary key, cos and sin [positions, head_dim] of positions 0..n-1 with n >= count (made again at twice
        the size when a forward reaches past them, never past the model's positions while the forward stays within
        them: a long-context model would otherwise hold a table twice the size of any position it reaches)."""
        if self._rope_table_size < count:
            size = max(ROPE_TABLE_MIN, 1 << (count - 1).bit_length())
            if self.max_length and count <= self.max_length:
                size = min(size, self.max_length)
            rows = self._rotary(torch.arange(size, device=self.device))
            self._rope_table = {key: (cos[0], sin[0]) for key, (cos, sin) in rows.items()}
            self._rope_table_size = size
        return self._rope_table

    def _stack(self, caches: list[StaticCache], feeds: list[Feed]) -> tuple[list[Part], torch.Tensor, torch.Tensor]:
        """Each sequence's `Part` of the stacked rows, and the stacked tokens [rows] and positions [rows]."""
        parts, all_tokens, all_positions, first = [], [], [], 0
        for cache, feed in zip(caches, feeds):
            n, past = feed.tokens.shape[0], cache.length
            cache.reserve(past + n)
            causal = feed.positions is None and feed.tree_mask is None
            positions = feed.positions
            positions = (
                torch.arange(past, past + n, device=self.device) if positions is None else positions.to(self.device)
            )
            parts.append(Part(cache, first, n, past, self._masks(positions, feed.tree_mask, causal, past, n)))
            all_tokens.append(feed.tokens)
            all_positions.append(positions)
            first += n
        if len(feeds) == 1:
            return parts, all_tokens[0], all_positions[0]
        return parts, torch.cat(all_tokens), torch.cat(all_positions)

    def _layer_stack(self, kernels):
        """Every layer in one kernel call (`LayerStack`, csrc/region.cpp: the layers' phases in one parallel region)
        where every layer is a one-call layer of q8 products (runs of them: a K-quant file's q|k and v) with the same
        window and rotary tables; else None."""
        fused = [layer.fused for layer in self.layers]
        if kernels is None or any(f is None or not all(q8_runs(w) for w in f) for f in fused):
            return None
        if len(set(self.windows)) != 1 or len(set(self.rope_keys)) != 1:
            return None
        norms_in, norms_post = [layer.norm_in for layer in self.layers], [layer.norm_mlp for layer in self.layers]
        eps, scales = [layer.eps for layer in self.layers], [layer.scaling for layer in self.layers]
        products = ([f[k] for f in fused] for k in range(4))  # qkv, o, gate_up, down: each layer's
        return kernels.LayerStack(norms_in, norms_post, eps, scales, *products, self.n_heads, self.head_dim)

    def _stacked_layers(self, h, cos, sin, parts: list[Part], skips: list[int]) -> torch.Tensor:
        """Every layer of short sequences in one call (`LayerStack.forward`): what `_fused_layer` and the op-by-op
        layers do a layer at a time, in the same order, so the same bits; `skips` per layer: 1 attention, 2 the MLP
        left out (a layer-skipping draft's), or empty."""
        keys = [p.cache.keys[i] for i in range(len(self.layers)) for p in parts]
        values = [p.cache.values[i] for i in range(len(self.layers)) for p in parts]
        masks = self._part_masks(parts, self.windows[0])
        firsts, ns, pasts = [p.first for p in parts], [p.n for p in parts], [p.past for p in parts]
        return self.stack.forward(h, cos, sin, keys, values, firsts, ns, pasts, masks, skips)

    def _part_masks(self, parts: list[Part], window: int | None) -> list[torch.Tensor]:
        """Each sequence's mask for a layer of this window, as the kernels take it (empty: attend everything)."""
        return [self.no_mask if p.masks[window] is None else p.masks[window] for p in parts]

    def _fused_layer(self, i: int, layer: LayerWeights, h, cos, sin, parts: list[Part]) -> torch.Tensor:
        """Layer i of short sequences in one kernel call; cos, sin [rows, head_dim] (the kernels' layout)."""
        masks = self._part_masks(parts, self.windows[i])
        if len(parts) == 1:
            part = parts[0]
            return self.layer_kernel(
                h, layer.norm_in, layer.norm_mlp, layer.eps, *layer.fused, cos, sin, part.cache.keys[i],
                part.cache.values[i], part.past, self.n_heads, masks[0], layer.scaling,
            )  # fmt: skip
        return self.layer_many(
            h, layer.norm_in, layer.norm_mlp, layer.eps, *layer.fused, cos, sin,
            [p.cache.keys[i] for p in parts], [p.cache.values[i] for p in parts],
            [p.first for p in parts], [p.n for p in parts], [p.past for p in parts], self.n_heads, masks, layer.scaling,
        )  # fmt: skip

    def _outputs(self, h: torch.Tensor, parts: list[Part], feeds: list[Feed]) -> list[Forward]:
        """Per sequence: logits of the rows that need them, and the hidden states asked for."""
        out_rows, state_rows = [], []  # per sequence: (first row, count) that get logits, those whose states return
        for p, feed in zip(parts, feeds):
            m = feed.last or p.n
            out_rows.append((p.first + p.n - m, m))
            state_rows.append((p.first, p.n) if feed.hidden == "all" else out_rows[-1] if feed.hidden else None)
        vocab = feeds[0].vocab  # a batch drafts from one vocabulary (or all of it)
        if any(feed.vocab is not vocab for feed in feeds):
            raise ValueError("a stacked forward's feeds must share one draft vocabulary")
        if len(feeds) == 1 and state_rows[0] in (None, out_rows[0]):  # normalise only the rows that need logits
            b, m = out_rows[0]
            states = self.final_states(h[b : b + m])
            return [Forward(self.logits(states, vocab), states if state_rows[0] else None)]
        states = self.final_states(h)
        if len(feeds) == 1:
            b, m = out_rows[0]
            logits = [self.logits(states[b : b + m], vocab)]
        else:
            counts = [m for _, m in out_rows]
            index = torch.cat([torch.arange(b, b + m, device=self.device) for b, m in out_rows])
            stacked = Spans(list(zip(itertools.accumulate([0, *counts[:-1]]), counts)), self.device)
            head = self.head if vocab is None else self._vocab_head(vocab)
            logits = self._widen(softcap(stacked(head, states[index]), self.final_cap), vocab).split(counts)
        return [Forward(lg, None if s is None else states[s[0] : s[0] + s[1]]) for lg, s in zip(logits, state_rows)]

    def final_states(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm of hidden states [m, H] (each row alone)."""
        return rms_norm(h, self.norm, self.norm_eps)

    def logits(self, states: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [m, V] of final states [m, H], soft-capped where the model caps them (Gemma); with a draft
        `vocab` (`Feed.vocab`), those tokens' logits from their rows of the head, every other -inf."""
        head = self.head if vocab is None else self._vocab_head(vocab)
        return self._widen(softcap(head(states), self.final_cap), vocab)

    def _vocab_head(self, vocab: torch.Tensor) -> PackedLinear:
        """The LM head's rows of `vocab` as a draft multiplies them (`PackedLinear` with `draft`: a rounded copy),
        made once per vocabulary. The rows are the head's own: a GGUF model's read from the file, exact."""
        key = (vocab.data_ptr(), vocab.numel())
        if key not in self._vocab_heads:
            head, ids = self.model.get_output_embeddings(), vocab.to(self.device)
            rows = head(ids) if hasattr(head, "rows") else head.weight.detach()[ids]
            rows = SimpleNamespace(weight=rows.contiguous(), bias=None, out_features=ids.numel())
            self._vocab_heads[key] = (vocab, PackedLinear([rows], draft=True))  # the key's tensor kept alive
        return self._vocab_heads[key][1]

    def _widen(self, logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Logits [m, N] of a draft vocabulary's tokens as [m, V], every other token -inf (logits itself without)."""
        return logits if vocab is None else vocab_logits(logits, vocab, self.head.out_features)

    def _masks(self, positions, tree_mask, causal: bool, past: int, n: int) -> dict:
        """`window_masks` per window size; None = attend everything (one causal token within every window)."""
        if causal and n == 1 and all(w is None or past < w for w in set(self.windows)):
            return {w: None for w in set(self.windows)}
        return window_masks(positions, tree_mask, past, self.windows)


def _rows(cos: torch.Tensor, sin: torch.Tensor, part: Part) -> tuple[torch.Tensor, torch.Tensor]:
    return cos[part.first : part.first + part.n], sin[part.first : part.first + part.n]
