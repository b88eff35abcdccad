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

from draftverify.backend.attention import rotated
from draftverify.backend.cache import StaticCache
from draftverify.backend.decoder import StaticDecoder, _post
from draftverify.backend.feed import Feed, Forward
from draftverify.backend.ops import gated, rms_norm, softcap, vocab_logits
from draftverify.errors import require

GRAPH_ROWS = 32  # new tokens of every forward (`GraphedDecoder.rows`)
TREE_FORWARDS = 16  # a tree or window feed holds at most this many forwards' rows (causal feeds: any number)
TAIL = 64  # B of `keys_by_position`: a tree deeper than this is refused


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
        # the graphs' inputs (`_inputs`): token ids | row positions | write slots | shared bounds | tails' slots
        # [rows, 2 TAIL], and which tail entries each row reads
        self.index = torch.zeros(4 * rows + rows * 2 * TAIL, dtype=torch.long, device=self.device)
        self.seen = torch.zeros(rows, 2 * TAIL, dtype=torch.bool, device=self.device)
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
        tokens = feed.tokens.to("cpu")  # the host's ids (the Runner leaves them there): no copy
        positions = torch.arange(base, base + n) if feed.positions is None else feed.positions.to("cpu")
        require(
            causal or (n <= self.tree_rows and (feed.tree_mask is None or int(positions.max()) - base < TAIL)),
            f"a tree of {n} tokens, {int(positions.max()) - base + 1} deep, is more than backend 'graph' takes "
            f"({self.tree_rows} tokens, {TAIL} deep): draft less",
        )
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
        """Load rows first..first+m-1 of a feed into the graphs' inputs (`keys_by_position`). A causal feed's
        forwards each start after the one before and its rows sit at slot = position; a tree's rows sit at base +
        their index in the feed. A padding row writes slot `past` + row (past the rows in use) and reads it alone."""
        w, tail = self.rows, TAIL
        past, offset = (base + first, 0) if causal else (base, first)
        rowpos = positions[first : first + m]
        if causal:
            shared, slots, seen = keys_by_position(rowpos, past + torch.arange(m), past, causal=True)
        else:
            attends = torch.ones(m, len(positions), dtype=torch.bool).tril(first) if tree is None else tree[first:]
            shared, slots, seen = keys_by_position(rowpos, positions, base, attends=attends[:m])
        pad = torch.arange(m, w)
        index = torch.zeros(self.index.shape[0], dtype=torch.long)
        index[:m], index[w : w + m] = tokens[first : first + m], rowpos
        index[2 * w : 3 * w] = torch.arange(past + offset, past + offset + w)
        index[3 * w : 3 * w + m] = shared
        table = torch.zeros(w, 2 * tail, dtype=torch.long)
        table[:m] = slots
        table[pad, 0] = past + offset + pad
        index[4 * w :] = table.view(-1)
        ok = torch.zeros(w, 2 * tail, dtype=torch.bool)
        ok[:m] = seen
        ok[pad, 0] = True
        if self.capture:  # pinned: the copies run in order on the stream, the host goes on
            index, ok = index.pin_memory(), ok.pin_memory()
        self.index.copy_(index, non_blocking=True)
        self.seen.copy_(ok, non_blocking=True)

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
                out = self._attend(q, keys, values, masks[inner.windows[i]], layer.scaling).to(h.dtype)
                h = h + _post(layer.o(out), layer.norm_attn_out)
            if i not in skip_mlp:
                up = gated(layer.gate_up(rms_norm(h, layer.norm_mlp, layer.eps)), layer.activation)
                h = h + _post(layer.down(up), layer.norm_mlp_out)
        states = rms_norm(h, inner.norm, inner.norm_eps)
        return states, softcap(inner.head(states), inner.final_cap)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scaling: float) -> torch.Tensor:
        """Attention of the loaded rows, in fp32, each row's keys by position (`keys_by_position`): scores against
        every slot (read below the row's shared bound) and against its tail, one softmax over both, then the two
        weighted sums added. q [rows, heads, d]; keys, values [kv heads, capacity, d] -> [rows, heads * d]."""
        inner, w = self.inner, self.rows
        kv, group, d = inner.n_kv, inner.n_heads // inner.n_kv, inner.head_dim
        tails = self.index[4 * w :]  # [rows * 2 TAIL]
        keys, values = keys.float(), values.float()
        qg = q.float().view(w, kv, group, d).transpose(0, 1)  # [kv, rows, group, d]: head h reads kv head h // group
        tail_keys = keys[:, tails].view(kv, w, 2 * TAIL, d)
        tail_values = values[:, tails].view(kv, w, 2 * TAIL, d)
        scores = torch.cat(
            [
                torch.matmul(qg.reshape(kv, w * group, d), keys.transpose(1, 2)).view(kv, w, group, -1),
                torch.matmul(qg, tail_keys.transpose(2, 3)),  # [kv, rows, group, 2 TAIL]
            ],
            dim=-1,
        ).mul_(scaling)
        probs = scores.masked_fill_(~mask[None, :, None, :], float("-inf")).softmax(-1)
        capacity = keys.shape[1]
        out = torch.matmul(probs[..., :capacity].reshape(kv, w * group, capacity), values).view(kv, w, group, d)
        out = out + torch.matmul(probs[..., capacity:], tail_values)
        return out.transpose(0, 1).reshape(w, inner.n_heads * d)

    def _masks(self, capacity: int, rowpos: torch.Tensor) -> dict:
        """Per window size, which keys each row reads, [rows, capacity + 2 TAIL] (`keys_by_position`): slots below
        the row's shared bound, then its tail's, each within the window (row position - key position < window)."""
        w = self.rows
        shared = self.index[3 * w : 4 * w, None]
        slot = torch.arange(capacity, device=self.device)
        tail_positions = shared + torch.arange(2 * TAIL, device=self.device)  # [rows, 2 TAIL]
        masks = {}
        for window in set(self.inner.windows):
            below, seen = slot[None, :] < shared, self.seen
            if window is not None:
                below = below & (rowpos[:, None] - slot[None, :] < window)
                seen = seen & (rowpos[:, None] - tail_positions < window)
            masks[window] = torch.cat([below, seen], dim=1)
        return masks


def keys_by_position(rowpos, positions, committed: int, causal: bool = False, attends=None):
    """Which keys each row of a forward reads, laid out by position, so a row's attention sums the same terms in the
    same places in any forward: the rows of a tree read their ancestors from the tree's slots, yet each term sits
    where it sits when that row is decoded alone (where every position's key is at slot = position).

    A row at position p reads positions below its shared bound s = B * (p // B) - B (B = `TAIL`) from the cache's
    slots in place, and positions s..p from its tail: 2 B gathered slots, position s + t at entry t. `rowpos` [m]:
    the rows' positions; `positions` [n]: the positions of the feed's rows (slots `committed` onwards; a causal
    forward's: slot = position); `attends` [m, n]: which feed rows each row reads (a tree's mask rows). A row's
    shared bound is at most `committed` (a tree's row deeper than B below it would read its ancestors out of
    place: a lookahead window row, whose outputs only draft, or a refused tree). -> shared bounds [m], the tails'
    slots [m, 2 B] and whether each is read [m, 2 B]."""
    shared = ((rowpos // TAIL) * TAIL - TAIL).clamp(min=0).clamp(max=committed)
    at = shared[:, None] + torch.arange(2 * TAIL)  # [m, 2 B] the tails' positions
    if causal:
        return shared, at, at <= rowpos[:, None]
    seen = at < committed
    slots = torch.where(seen, at, 0)
    rows, cols = attends.nonzero(as_tuple=True)
    entry = positions[cols] - shared[rows]
    inside = (entry >= 0) & (entry < 2 * TAIL)
    slots[rows[inside], entry[inside]] = committed + cols[inside]
    seen[rows[inside], entry[inside]] = True
    return shared, slots, seen
