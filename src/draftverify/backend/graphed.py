"""The GPU path: every forward one shape, captured once as a CUDA graph and replayed.

On a GPU a small model's step is host-bound (docs/backends.md, CUDA): its kernels run a small part of the step and
the rest is Python and kernel launches. `GraphedDecoder` records one forward per cache as a CUDA graph and replays
it, so a forward costs a few small copies and one launch from the host.

A graph needs one shape, so every forward has one: `rows` new tokens (fewer are padded with rows whose outputs are
dropped, more are fed `rows` at a time) attending the cache's whole buffer through a mask that the graph forms on the
device from the feed's positions and tree. That shape also makes each row's arithmetic independent of the forward
it is in: every product runs the same kernel on the same shapes, a row's sums read only its own inputs, and a
masked key adds an exact zero. So a verified row gets the bits of a one-token step in any dtype, and bf16 on CUDA is
lossless on this backend, where the eager and static ones round a several-row forward differently from a one-row
one (docs/backends.md). Prefill pays for it: a prompt runs `rows` tokens a forward.

The weights and the layer recipe are the static decoder's (`StaticDecoder`: the stock model's own modules, products
on its weights). Off CUDA the same forward runs without a graph (the tests run it on a CPU); a layer-skipping draft
forward (`Feed.skip`) also runs without one. Soft-capped attention (Gemma 2) and rotary frequencies that change per
forward are refused at construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftverify.backend.attention import rotated
from draftverify.backend.cache import StaticCache
from draftverify.backend.decoder import StaticDecoder, _post
from draftverify.backend.feed import Feed, Forward
from draftverify.backend.ops import gated, rms_norm, softcap, vocab_logits
from draftverify.errors import require

GRAPH_ROWS = 32  # new tokens of every forward (`GraphedDecoder.rows`)
TREE_FORWARDS = 16  # a tree or window feed holds at most this many forwards' rows (causal feeds: any number)


class GraphCache(StaticCache):
    """A `StaticCache` with the graphs captured over its buffers (they keep their addresses until it grows)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.graphs: dict = {}

    def fork(self) -> "GraphCache":
        return GraphCache(*self.shape, self.dtype, self.device, self.max_length)

    def reserve(self, needed: int) -> None:
        capacity = self.capacity
        super().reserve(needed)
        if self.capacity != capacity:  # new buffers: the graphs read the old ones
            self.graphs.clear()


class GraphedDecoder:
    """A stock Llama-family model whose every forward is `rows` rows (see the module docstring); each sequence has a
    `GraphCache` (`new_cache`)."""

    def __init__(self, model: torch.nn.Module, draft: bool = False, packs=None, rows: int | None = None):
        self.inner = inner = StaticDecoder(model, draft, packs)
        rows = rows or GRAPH_ROWS
        require(
            all(layer.softcap is None for layer in inner.layers),
            "backend 'graph' cannot run soft-capped attention (Gemma 2): use --backend eager",
        )
        require(inner._rope_fixed, "backend 'graph' needs fixed rotary frequencies: use --backend eager")
        require(inner.max_length is not None, "backend 'graph' needs the model's max_position_embeddings")
        self.rows, self.tree_rows = rows, rows * TREE_FORWARDS
        self.device, self.dtype, self.max_length = inner.device, inner.dtype, inner.max_length
        self.capture = self.device.type == "cuda"
        self.input_device = torch.device("cpu")  # feeds' tokens stay on the host: they travel in one copy
        # per rotary key, cos and sin [positions, head dim] of every position the model takes (`rows` more: the
        # padding rows of a forward near the end of the context)
        self.tables = inner._rope_tables(inner.max_length + rows)
        # the graphs' inputs: token ids | row positions | write slots | cache length before the feed | the feed's
        # positions by row (`tree_rows`), and which of the feed's rows each row attends
        self.index = torch.zeros(3 * rows + 1 + self.tree_rows, dtype=torch.long, device=self.device)
        self.tree = torch.zeros(rows, self.tree_rows, dtype=torch.bool, device=self.device)
        self.graphs_captured = 0

    @property
    def rows_alone(self) -> bool:
        return True  # every forward one shape: a row's bits never depend on the rows beside it

    def new_cache(self) -> GraphCache:
        inner = self.inner
        return GraphCache(len(inner.layers), inner.n_kv, inner.head_dim, inner.kv_dtype, self.device, self.max_length)

    def forward_many(self, caches: list[GraphCache], feeds: list[Feed]) -> list[Forward]:
        return [self.forward(cache, feed) for cache, feed in zip(caches, feeds)]

    @torch.inference_mode()
    def forward(self, cache: GraphCache, feed: Feed) -> Forward:
        """Feed `feed.tokens` [n] after `cache`'s tokens, `rows` of them a forward."""
        n, w, base = feed.size, self.rows, cache.length
        causal = feed.positions is None and feed.tree_mask is None
        require(
            causal or n <= self.tree_rows,
            f"a tree or window of {n} tokens is more than backend 'graph' takes ({self.tree_rows}): draft fewer",
        )
        tokens = feed.tokens.to("cpu")  # the host's ids (the Runner leaves them there): no copy
        positions = torch.arange(base, base + n) if feed.positions is None else feed.positions.to("cpu")
        tree = feed.tree_mask.to("cpu") if feed.tree_mask is not None else None
        cache.reserve(base + -(-n // w) * w)  # the last forward's padding rows write slots too
        want = feed.last or n
        logits, states = [], []
        for first in range(0, n, w):
            m = min(w, n - first)
            self._inputs(tokens, positions, tree, base, first, m, causal)
            out_states, out_logits = self._run(cache, feed.skip)
            keep = slice(max(0, n - want - first), m)  # this forward's rows that return logits
            if keep.start < m:
                logits.append(out_logits[keep].clone())
            if feed.hidden == "all":
                states.append(out_states[:m].clone())
            elif feed.hidden and keep.start < m:
                states.append(out_states[keep].clone())
        cache.length = base + n
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        if feed.vocab is not None:  # a draft's vocabulary: its tokens' logits, every other -inf
            vocab = feed.vocab.to(self.device)
            logits = vocab_logits(logits.index_select(1, vocab), vocab, logits.shape[1])
        hidden = (torch.cat(states) if len(states) > 1 else states[0]) if feed.hidden else None
        return Forward(logits, hidden)

    def _inputs(self, tokens, positions, tree, base: int, first: int, m: int, causal: bool) -> None:
        """Load rows first..first+m-1 of a feed into the graphs' inputs. A causal feed's forwards each start after
        the one before (`past` moves on); a tree's all start at `base` and read the tree's columns up to its end.
        A padding row sits at slot past + row, attends that slot alone and writes it (past the rows in use)."""
        w = self.rows
        past, offset = (base + first, 0) if causal else (base, first)
        index = torch.zeros(self.index.shape[0], dtype=torch.long)
        index[:m] = tokens[first : first + m]
        index[w : w + m] = positions[first : first + m]
        index[2 * w : 3 * w] = torch.arange(past + offset, past + offset + w)
        index[3 * w] = past
        rows = torch.zeros(w, self.tree_rows, dtype=torch.bool)
        if causal:
            index[3 * w + 1 : 3 * w + 1 + m] = positions[first : first + m]
            rows[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
        else:
            n = positions.shape[0]
            index[3 * w + 1 : 3 * w + 1 + n] = positions
            rows[:m, :n] = torch.ones(m, n, dtype=torch.bool).tril(first) if tree is None else tree[first : first + m]
        pad = torch.arange(m, w)
        rows[pad, offset + pad] = True
        if self.capture:  # pinned: the copies run in order on the stream, the host goes on
            index, rows = index.pin_memory(), rows.pin_memory()
        self.index.copy_(index, non_blocking=True)
        self.tree.copy_(rows, non_blocking=True)

    def _run(self, cache: GraphCache, skip) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the loaded inputs: the cache's graph replayed (captured on first use), else run."""
        if skip is not None or not self.capture:
            return self._layers(cache, skip)
        graph = cache.graphs.get("forward")
        if graph is None:
            graph = cache.graphs["forward"] = self._capture(cache)
        graph[0].replay()
        return graph[1]

    def _capture(self, cache: GraphCache) -> tuple:
        """The forward over `cache` recorded as a CUDA graph, and its outputs. It runs once first, off the capture
        (CUDA's rule for kernels' lazy set-up): on the loaded inputs, so it writes what the replay writes."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._layers(cache, None)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._layers(cache, None)
        self.graphs_captured += 1
        return graph, outputs

    def _layers(self, cache: GraphCache, skip) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over the loaded inputs: final states [rows, H] and logits [rows, V]."""
        inner, w = self.inner, self.rows
        tokens, rowpos, slots = self.index[:w], self.index[w : 2 * w], self.index[2 * w : 3 * w]
        masks = self._masks(cache.capacity, rowpos)
        ropes = {key: (cos[rowpos][:, None], sin[rowpos][:, None]) for key, (cos, sin) in self.tables.items()}
        skip_attn = set(skip.attention) if skip is not None else ()
        skip_mlp = set(skip.mlp) if skip is not None else ()
        h = inner.embed(tokens)  # [rows, H] (the stock module: Gemma's scaling included)
        for i, layer in enumerate(inner.layers):
            if i not in skip_attn:
                q, k, v = rotated(
                    inner, layer, layer.qkv(rms_norm(h, layer.norm_in, layer.eps)), *ropes[inner.rope_keys[i]]
                )
                keys, values = cache.keys[i], cache.values[i]
                keys.index_copy_(1, slots, k.transpose(0, 1).to(keys.dtype))
                values.index_copy_(1, slots, v.transpose(0, 1).to(values.dtype))
                out = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0),  # [1, heads, rows, d]
                    keys.unsqueeze(0).to(q.dtype),  # [1, kv heads, capacity, d]
                    values.unsqueeze(0).to(q.dtype),
                    attn_mask=masks[inner.windows[i]],
                    scale=layer.scaling,
                    enable_gqa=inner.n_heads != inner.n_kv,
                )
                out = out[0].transpose(0, 1).reshape(w, inner.n_heads * inner.head_dim)
                h = h + _post(layer.o(out), layer.norm_attn_out)
            if i not in skip_mlp:
                up = gated(layer.gate_up(rms_norm(h, layer.norm_mlp, layer.eps)), layer.activation)
                h = h + _post(layer.down(up), layer.norm_mlp_out)
        states = rms_norm(h, inner.norm, inner.norm_eps)
        return states, softcap(inner.head(states), inner.final_cap)

    def _masks(self, capacity: int, rowpos: torch.Tensor) -> dict:
        """Per window size, the boolean mask [1, 1, rows, capacity] of the loaded feed, formed on the device: every
        slot before `past` (slot j holds position j), and the feed's slots its tree lets the row see, within the
        window (row position - key position < window)."""
        past, fresh_positions = self.index[3 * self.rows], self.index[3 * self.rows + 1 :]
        slot = torch.arange(capacity, device=self.device)
        rel = slot - past
        fresh = (rel >= 0) & (rel < self.tree_rows)
        rel = rel.clamp(0, self.tree_rows - 1)
        seen = (slot < past).unsqueeze(0) | (self.tree[:, rel] & fresh.unsqueeze(0))  # [rows, capacity]
        key_positions = torch.where(fresh, fresh_positions[rel], slot)
        masks = {}
        for window in set(self.inner.windows):
            near = seen if window is None else seen & (rowpos[:, None] - key_positions[None, :] < window)
            masks[window] = near[None, None]
        return masks
