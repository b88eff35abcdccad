"""The GPU path: every forward one shape, captured once as a CUDA graph and replayed.

On a GPU a small model's step is host-bound (docs/backends.md, CUDA): its kernels run a small part of the step and
the rest is Python and kernel launches. `GraphedDecoder` records one forward per cache as a CUDA graph and replays
it, so a forward costs a few small copies and one launch from the host.

A graph needs fixed shapes, so every forward has them: `rows` new tokens (fewer are padded with rows whose outputs
are dropped, more are fed `rows` at a time, in position order) over caches made once at their whole context,
attending a span of slots that is a function of the row's position alone (`_span`: one graph per span), through
masks the graph forms on the device. The shapes also make each row's arithmetic independent of the forward it is in:
every product runs the same kernel on the same shapes, a row's sums read only its own inputs, a masked key adds an
exact zero, and a row reads its keys laid out by position (`keys_by_position`), so a tree's row sums the same terms in
the same places as when it is decoded alone, in whatever order the GPU reduces them. So a verified row gets the bits
of a one-token step in any dtype, where the eager and static backends round a several-row forward differently from a
one-row one on a GPU (docs/backends.md). Prefill pays for it: a prompt runs `rows` tokens a forward.

The weights and the layer recipe are the static decoder's (`StaticDecoder`: the stock model's own modules, products
on its weights), read only through `decoder.DecoderParts`; its layers run op by op as the static decoder's do
(`ops.run_layer`), with this module's attention. Off CUDA the same forward runs without a graph (the tests run it on
a CPU); a layer-skipping draft forward (`Feed.skip`) also runs without one. Soft-capped attention (Gemma 2) and
rotary frequencies that change per forward are refused at construction.
"""

from __future__ import annotations

import sys

import torch

from draftverify.backend.attention import rotated
from draftverify.backend.cache import StaticCache
from draftverify.backend.decoder import DecoderParts, StaticDecoder
from draftverify.backend.feed import Feed, Forward
from draftverify.backend.ops import run_layer, vocab_logits
from draftverify.errors import require

GRAPH_ROWS = 32  # new tokens of every forward (`GraphedDecoder.rows`)
TREE_FORWARDS = 16  # a tree or window feed holds at most this many forwards' rows (causal feeds: any number)
TAIL = 64  # B of `keys_by_position`: a tree deeper than this is refused
SPAN_MIN = 256  # the fewest slots a forward attends over (`GraphedDecoder._span`)
GRAPH_CONTEXT = 32768  # the most positions a sequence reaches on this backend (every cache holds them all)


class GraphCache(StaticCache):
    """A `StaticCache` whose buffers are made once, at the decoder's whole context (the graphs captured over them
    read their addresses), with the graphs it has: one per attention span (`GraphedDecoder._span`). The last
    `rows` slots (from `scratch`) are where a forward's padding rows write."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, slots: int, scratch: int):
        super().__init__(layers, kv_heads, head_dim, dtype, device, slots)
        super().reserve(slots)
        self.scratch = scratch
        self.graphs: dict = {}

    def fork(self) -> "GraphCache":
        return GraphCache(*self.shape, self.dtype, self.device, self.capacity, self.scratch)

    def reserve(self, needed: int) -> None:
        require(
            needed <= self.scratch,
            f"{needed} tokens are more than this cache holds ({self.scratch}): shorten the prompt or the reply",
        )


class GraphedDecoder:
    """A stock Llama-family model whose every forward is `rows` rows (see the module docstring); each sequence has a
    `GraphCache` (`new_cache`). `context`: the most positions a sequence may reach (at most the model's; every
    cache holds them all)."""

    def __init__(self, model: torch.nn.Module, draft: bool = False, packs=None, rows: int | None = None, context=None):
        self.inner: DecoderParts = StaticDecoder(model, draft, packs)
        inner = self.inner
        rows = rows or GRAPH_ROWS
        require(
            all(layer.softcap is None for layer in inner.layers),
            "backend 'graph' cannot run soft-capped attention (Gemma 2): use --backend eager",
        )
        require(inner.rope_fixed, "backend 'graph' needs fixed rotary frequencies: use --backend eager")
        require(inner.max_length is not None, "backend 'graph' needs the model's max_position_embeddings")
        self.rows, self.tree_rows = rows, rows * TREE_FORWARDS
        self.device, self.dtype = inner.device, inner.dtype
        self.max_length = min(inner.max_length, context or GRAPH_CONTEXT)
        self.capture = self.device.type == "cuda"
        self.input_device = torch.device("cpu")  # feeds' tokens stay on the host: they travel in one copy
        # per rotary key, cos and sin [positions, head dim] of every position a row may take (a tree's or window's
        # rows may sit up to `tree_rows` past the context)
        self.tables = inner.rope_tables(self.max_length + self.tree_rows)
        # the graphs' inputs (`_inputs`): token ids | row positions | write slots | shared bounds | tails' slots
        # [rows, 2 TAIL], and which tail entries each row reads
        self.index = torch.zeros(4 * rows + rows * 2 * TAIL, dtype=torch.long, device=self.device)
        self.seen = torch.zeros(rows, 2 * TAIL, dtype=torch.bool, device=self.device)
        self.graphs_captured = 0

    @property
    def rows_alone(self) -> bool:
        return True  # every forward one shape per span: a row's bits never depend on the rows beside it

    def new_cache(self) -> GraphCache:
        inner, slots = self.inner, self.max_length + self.tree_rows
        return GraphCache(
            len(inner.layers), inner.n_kv, inner.head_dim, inner.kv_dtype, self.device, slots + self.rows, slots
        )

    def forward_many(self, caches: list[GraphCache], feeds: list[Feed]) -> list[Forward]:
        return [self.forward(cache, feed) for cache, feed in zip(caches, feeds)]

    @torch.inference_mode()
    def forward(self, cache: GraphCache, feed: Feed) -> Forward:
        """Feed `feed.tokens` [n] after `cache`'s tokens: runs of at most `rows` rows of one span, in order."""
        n, base = feed.size, cache.length
        tokens = feed.tokens.to("cpu")  # the host's ids (the Runner leaves them there): no copy
        positions = torch.arange(base, base + n) if feed.positions is None else feed.positions.to("cpu")
        tree = feed.tree_mask.to("cpu") if feed.tree_mask is not None else None
        causal = tree is None and bool((positions == base + torch.arange(n)).all())  # slot = position throughout
        deepest = int(positions.max()) - base
        require(
            causal or (n <= self.tree_rows and deepest < TAIL),
            f"a tree of {n} tokens, {deepest + 1} deep, is more than backend 'graph' takes "
            f"({self.tree_rows} tokens, {TAIL} deep): draft less",
        )
        cache.reserve(base + n)
        asked = n - (feed.last or n)  # rows from here on return logits
        # the rows in the order they run: by position, so a row's keys are written first (a lookahead window's rows
        # come before its root); out of order, every row is kept as it runs and those asked for picked after
        in_order = bool((positions[1:] >= positions[:-1]).all())
        order = torch.arange(n) if in_order else torch.argsort(positions, stable=True)
        keep = asked if in_order else 0
        logits, states = [], []
        for start, end in self._runs(positions[order]):
            rows = order[start:end]
            self._inputs(tokens, positions, None if causal else tree, base, rows, cache.scratch, causal)
            out_states, out_logits = self._run(cache, self._span(int(positions[rows].max())), feed.skip)
            first = max(start, keep) - start
            if first < end - start:
                logits.append(out_logits[first : end - start].clone())
            if feed.hidden == "all" or (feed.hidden and first < end - start):
                states.append(out_states[0 if feed.hidden == "all" else first : end - start].clone())
        cache.length = base + n
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        hidden = (torch.cat(states) if len(states) > 1 else states[0]) if feed.hidden else None
        if not in_order:  # back to the feed's order, the rows asked for
            where = torch.empty_like(order)
            where[order] = torch.arange(n)
            picked = where[asked:].to(self.device)
            logits = logits.index_select(0, picked)
            hidden = (
                None
                if hidden is None
                else hidden.index_select(0, where.to(self.device) if feed.hidden == "all" else picked)
            )
        if feed.vocab is not None:  # a draft's vocabulary: its tokens' logits, every other -inf
            vocab = feed.vocab.to(self.device)
            logits = vocab_logits(logits.index_select(1, vocab), vocab, logits.shape[1])
        return Forward(logits, hidden)

    def _span(self, position: int) -> int:
        """The slots a row at `position` attends over (its shared part's length): the power of two above it, at least
        `SPAN_MIN`, at most the cache's. A function of the position alone, so a row gets the same shapes wherever it
        is decoded."""
        return min(max(SPAN_MIN, 1 << position.bit_length()), self.max_length + self.tree_rows)

    def _runs(self, positions: torch.Tensor) -> list[tuple[int, int]]:
        """Rows at these (nondecreasing) positions as runs start..end-1 of at most `rows` rows of one span: a row's
        keys sit at lower positions (its own aside), so each run's are written before it reads them."""
        spans = [self._span(p) for p in positions.tolist()]
        runs, start = [], 0
        for i in range(1, len(spans) + 1):
            if i == len(spans) or i - start == self.rows or spans[i] != spans[start]:
                runs.append((start, i))
                start = i
        return runs

    def _inputs(self, tokens, positions, tree, base: int, rows, scratch: int, causal: bool) -> None:
        """Load a feed's `rows` (indices) into the graphs' inputs (`keys_by_position`). Feed row i sits at slot base +
        i (a causal feed's: slot = position). A padding row writes a scratch slot and reads it alone."""
        w, m = self.rows, len(rows)
        rowpos = positions[rows]
        if causal:
            shared, slots, seen = keys_by_position(rowpos)
        else:
            attends = tree[rows] if tree is not None else torch.arange(len(positions))[None, :] <= rows[:, None]
            shared, slots, seen = keys_by_position(rowpos, positions, base, attends)
        pad = torch.arange(m, w)
        index = torch.zeros(self.index.shape[0], dtype=torch.long)
        index[:m], index[w : w + m] = tokens[rows], rowpos
        index[2 * w : 3 * w] = torch.cat([base + rows, scratch + pad])
        index[3 * w : 3 * w + m] = shared
        table = torch.zeros(w, 2 * TAIL, dtype=torch.long)
        table[:m], table[pad, 0] = slots, scratch + pad
        index[4 * w :] = table.view(-1)
        ok = torch.zeros(w, 2 * TAIL, dtype=torch.bool)
        ok[:m], ok[pad, 0] = seen, True
        if self.device.type == "cuda":  # pinned: the copies run in order on the stream, the host goes on
            index, ok = index.pin_memory(), ok.pin_memory()
        self.index.copy_(index, non_blocking=True)
        self.seen.copy_(ok, non_blocking=True)

    def _run(self, cache: GraphCache, span: int, skip) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the loaded inputs: the cache's graph of this span replayed (captured on first use), else
        run."""
        if skip is not None or not self.capture:
            return self._layers(cache, span, skip)
        graph = cache.graphs.get(span)
        if graph is None:
            try:
                graph = cache.graphs[span] = self._capture(cache, span)
            except RuntimeError as exc:  # the same forward runs without graphs: slower, the same bits
                self.capture = False
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"draftverify: no CUDA graphs ({first}): backend 'graph' runs without them", file=sys.stderr)
                return self._layers(cache, span, None)
        graph[0].replay()
        return graph[1]

    def _capture(self, cache: GraphCache, span: int) -> tuple:
        """The forward over `cache` recorded as a CUDA graph, and its outputs. It runs once first, off the capture
        (CUDA's rule for kernels' lazy set-up): on the loaded inputs, so it writes what the replay writes."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._layers(cache, span, None)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a server's other threads may use CUDA
            outputs = self._layers(cache, span, None)
        self.graphs_captured += 1
        return graph, outputs

    def _layers(self, cache: GraphCache, span: int, skip) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over the loaded inputs, attending `span` slots: final states [rows, H] and logits [rows, V]."""
        inner, w = self.inner, self.rows
        tokens, rowpos, slots = self.index[:w], self.index[w : 2 * w], self.index[2 * w : 3 * w]
        masks = self._masks(span, rowpos)
        ropes = {key: (cos[rowpos][:, None], sin[rowpos][:, None]) for key, (cos, sin) in self.tables.items()}
        skip_attn = set(skip.attention) if skip is not None else ()
        skip_mlp = set(skip.mlp) if skip is not None else ()
        h = inner.embed(tokens)  # [rows, H] (the stock module: Gemma's scaling included)
        for i, layer in enumerate(inner.layers):

            def attention(qkv, i=i, layer=layer):  # writes the rows' keys and values at their slots, then attends
                q, k, v = rotated(inner, layer, qkv, *ropes[inner.rope_keys[i]])
                keys, values = cache.keys[i], cache.values[i]
                keys.index_copy_(1, slots, k.transpose(0, 1).to(keys.dtype))
                values.index_copy_(1, slots, v.transpose(0, 1).to(values.dtype))
                return self._attend(q, keys, values, span, masks[inner.windows[i]], layer.scaling).to(h.dtype)

            h = run_layer(layer, h, attention, skip_attention=i in skip_attn, skip_mlp=i in skip_mlp)
        states = inner.final_states(h)
        return states, inner.logits(states)

    def _attend(self, q, keys: torch.Tensor, values: torch.Tensor, span: int, mask, scaling: float) -> torch.Tensor:
        """Attention of the loaded rows, in fp32, each row's keys by position (`keys_by_position`): scores against
        the first `span` slots (read below the row's shared bound) and against its tail, one softmax over both, then
        the two weighted sums added. q [rows, heads, d]; keys, values [kv heads, slots, d] -> [rows, heads * d]."""
        inner, w = self.inner, self.rows
        kv, group, d = inner.n_kv, inner.n_heads // inner.n_kv, inner.head_dim
        tails = self.index[4 * w :]  # [rows * 2 TAIL]
        tail_keys = keys[:, tails].float().view(kv, w, 2 * TAIL, d)
        tail_values = values[:, tails].float().view(kv, w, 2 * TAIL, d)
        keys, values = keys[:, :span].float(), values[:, :span].float()
        qg = q.float().view(w, kv, group, d).transpose(0, 1)  # [kv, rows, group, d]: head h reads kv head h // group
        scores = torch.cat(
            [
                torch.matmul(qg.reshape(kv, w * group, d), keys.transpose(1, 2)).view(kv, w, group, -1),
                torch.matmul(qg, tail_keys.transpose(2, 3)),  # [kv, rows, group, 2 TAIL]
            ],
            dim=-1,
        ).mul_(scaling)
        probs = scores.masked_fill_(~mask[None, :, None, :], float("-inf")).softmax(-1)
        out = torch.matmul(probs[..., :span].reshape(kv, w * group, span), values).view(kv, w, group, d)
        out = out + torch.matmul(probs[..., span:], tail_values)
        return out.transpose(0, 1).reshape(w, inner.n_heads * d)

    def _masks(self, span: int, rowpos: torch.Tensor) -> dict:
        """Per window size, which keys each row reads, [rows, span + 2 TAIL] (`keys_by_position`): slots below the
        row's shared bound, then its tail's, each within the window (row position - key position < window)."""
        w = self.rows
        shared = self.index[3 * w : 4 * w, None]
        slot = torch.arange(span, device=self.device)
        tail_positions = shared + torch.arange(2 * TAIL, device=self.device)  # [rows, 2 TAIL]
        masks = {}
        for window in set(self.inner.windows):
            below, seen = slot[None, :] < shared, self.seen
            if window is not None:
                below = below & (rowpos[:, None] - slot[None, :] < window)
                seen = seen & (rowpos[:, None] - tail_positions < window)
            masks[window] = torch.cat([below, seen], dim=1)
        return masks


def keys_by_position(rowpos, positions=None, committed: int = 0, attends=None):
    """Which keys each row of a forward reads, laid out by position, so a row's attention sums the same terms in the
    same places in any forward: the rows of a tree read their ancestors from the tree's slots, yet each term sits
    where it sits when that row is decoded alone (where every position's key is at slot = position).

    A row at position p reads positions below its shared bound s = B * (p // B) - B (B = `TAIL`) from the cache's
    slots in place, and positions s..p from its tail: 2 B gathered slots, position s + t at entry t. `rowpos` [m]:
    the rows' positions; `positions` [n]: the positions of the feed's rows (slots `committed` onwards; a causal
    forward's: slot = position); `attends` [m, n]: which feed rows each row reads (a tree's mask rows; None: a causal
    forward, every position up to the row's at slot = position). A tree's rows lie less than B below `committed`
    (`GraphedDecoder.forward` refuses deeper ones), so their shared bounds are below it: every slot a row reads in
    place holds the position it reads. -> shared bounds [m], the tails' slots [m, 2 B] and whether each is read."""
    shared = ((rowpos // TAIL) * TAIL - TAIL).clamp(min=0)
    at = shared[:, None] + torch.arange(2 * TAIL)  # [m, 2 B] the tails' positions
    if attends is None:
        return shared, at, at <= rowpos[:, None]
    seen = at < committed
    slots = torch.where(seen, at, 0)
    rows, cols = attends.nonzero(as_tuple=True)
    entry = positions[cols] - shared[rows]
    inside = (entry >= 0) & (entry < 2 * TAIL)
    slots[rows[inside], entry[inside]] = committed + cols[inside]
    seen[rows[inside], entry[inside]] = True
    return shared, slots, seen
