"""The graph backend (backend/graphed.py): every forward one shape, each row's keys laid out by position. On a CPU
it runs without CUDA graphs, the same forward; the tests check what makes it exact in any dtype."""

from __future__ import annotations

import pytest
import torch

from draftverify import Engine
from draftverify.backend import graphed
from draftverify.backend.graphed import TAIL, keys_by_position
from draftverify.errors import DraftVerifyError
from draftverify.kernels import cpu_flags
from draftverify.models import Runner

METHODS = [
    ("speculative", {"k": 4}),
    ("speculative", {"k": 7}),
    ("lookahead", {}),
    ("prompt-lookup", {}),
    ("self-speculative", {"strategy": "heuristic"}),
]
PROMPTS = ["Hello there, how", "def f(x):\n    return", "1, 2, 3, 4,", "The quick brown fox"]


@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "gemma3"])
def test_graph_forward_matches_the_stock_model(tiny, arch):
    target = tiny(arch)
    ids = list(range(2, 60))
    graph = Runner(target.model, "graph").forward(ids).logits
    stock = Runner(target.model, "eager").forward(ids).logits
    torch.testing.assert_close(graph, stock, rtol=1e-4, atol=1e-4)


def _identical(engine) -> tuple[int, int]:
    same = total = 0
    for prompt in PROMPTS:
        ar = engine.generate(prompt, method="autoregressive", max_new_tokens=80, eos_token_id=[]).tokens
        for method, options in METHODS:
            out = engine.generate(prompt, method=method, max_new_tokens=80, eos_token_id=[], **options).tokens
            same, total = same + (out == ar), total + 1
    return same, total


@pytest.mark.parametrize("rows", [32, 4])
def test_every_method_equals_plain_decoding_in_bf16_on_the_graph_backend(tokenizer, monkeypatch, rows):
    """bf16 is where a several-row forward rounds differently from a one-row one on the other backends (the static
    one is the control: some methods part from its plain decoding); with 4 rows a forward, prompts and trees run as
    several forwards."""
    from conftest import make_model

    from draftverify.loading import Loaded

    monkeypatch.setattr(graphed, "GRAPH_ROWS", rows)
    target = Loaded(make_model("llama", 0).to(torch.bfloat16), tokenizer, name="t")
    draft = Loaded(make_model("llama", 1, layers=2).to(torch.bfloat16), tokenizer, name="d")
    same, total = _identical(Engine(target, draft, backend="graph"))
    assert same == total
    if rows == 32 and "avx512_bf16" in cpu_flags():  # where oneDNN multiplies bf16 natively (seen on Zen 5, Xeon)
        same, total = _identical(Engine(target, draft, backend="static"))
        assert same < total  # the control: without one shape, bf16 speculation parts from plain decoding


def _read_by_position(shared, slots, seen, row) -> dict:
    """Position -> slot that `row` reads (its shared part in place, then its tail)."""
    read = {x: x for x in range(int(shared[row]))}
    for t in torch.nonzero(seen[row]).view(-1).tolist():
        read[int(shared[row]) + t] = int(slots[row, t])
    return read


@pytest.mark.parametrize("base", [5, 100, 250, 1000])
def test_a_trees_rows_read_their_keys_where_the_row_decoded_alone_reads_them(base):
    """Each tree row reads the committed prefix and its ancestors (from their tree slots), laid out exactly as the
    same row decoded alone lays out its keys (slot = position): the same shared bound, the same tail entries."""
    gen = torch.Generator().manual_seed(base)
    n = 40
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    depth, mask = [0] * n, torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        depth[i] = 0 if parent < 0 else depth[parent] + 1
        mask[i, i] = True
        if parent >= 0:
            mask[i] |= mask[parent]
    positions = base + torch.tensor(depth)
    shared, slots, seen = keys_by_position(positions, positions, base, mask)
    alone_shared, alone_slots, alone_seen = keys_by_position(positions)
    assert torch.equal(shared, alone_shared) and torch.equal(seen, alone_seen)
    for row in range(n):
        ancestors = {int(positions[j]): base + j for j in torch.nonzero(mask[row]).view(-1).tolist()}
        expected = {x: x for x in range(base)} | ancestors
        assert _read_by_position(shared, slots, seen, row) == expected
        assert _read_by_position(alone_shared, alone_slots, alone_seen, row) == {x: x for x in expected}


def test_a_rows_logits_do_not_depend_on_its_forward_or_the_caches_history(tiny):
    target = tiny("llama")
    runner = Runner(target.model, "graph")
    prompt = [2 + (7 * i) % 97 for i in range(298)]  # positions past 255: its end runs at a span of 512 slots
    runner.forward(list(range(3, 40)) * 12)  # another, longer sequence first
    runner.reset()
    runner.forward(prompt[:-1])
    alone = runner.forward(prompt[-1:]).logits[-1]
    runner.reset()
    runner.forward(prompt[:-5])
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0]])
    tree = torch.cat([tree, torch.tensor([[1, 0, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1]])]).bool()
    tokens = [prompt[-5], 7, prompt[-4], prompt[-3], prompt[-2], prompt[-1]]
    base = len(prompt) - 5
    positions = torch.tensor([base, base + 1, base + 1, base + 2, base + 3, base + 4])
    in_tree = runner.forward(tokens, positions=positions, tree_mask=tree).logits[-1]
    assert torch.equal(alone, in_tree)


def test_runs_split_where_the_span_changes_and_at_the_row_count(tiny):
    decoder = Runner(tiny("llama").model, "graph").decoder
    assert decoder._span(0) == decoder._span(255) == 256 and decoder._span(256) == 512
    assert decoder._runs(torch.arange(250, 300)) == [(0, 6), (6, 38), (38, 50)]


def test_the_graph_backend_refuses_what_it_cannot_run_in_one_line(tiny):
    with pytest.raises(DraftVerifyError, match="soft-capped attention"):
        Runner(tiny("gemma2").model, "graph")
    runner = Runner(tiny("llama").model, "graph")
    runner.forward([1, 2, 3])
    deep = torch.ones(TAIL + 1, TAIL + 1, dtype=torch.bool).tril()
    with pytest.raises(DraftVerifyError, match="deep"):
        runner.forward(list(range(TAIL + 1)), positions=torch.arange(3, TAIL + 4), tree_mask=deep)
    with pytest.raises(DraftVerifyError, match="more than this cache holds"):
        runner.forward(list(range(2000)))


def test_rows_run_in_position_order_so_a_row_before_its_keys_in_the_feed_reads_them(tiny, monkeypatch):
    """A lookahead window's rows come before the root they read (tree.layout); with 4 rows a forward they would
    run before it was written. Run by position, each row gets what it gets fed after the root."""
    monkeypatch.setattr(graphed, "GRAPH_ROWS", 4)
    runner = Runner(tiny("llama").model, "graph")
    prompt = [5, 9, 13, 17, 21, 25]
    root, window = 30, [31, 32, 33, 34]
    base = len(prompt)
    first = torch.eye(5, dtype=torch.bool)
    first[1:, 0] = True  # root first: every window row reads the root and itself
    runner.forward(prompt)
    after = runner.forward([root, *window], torch.tensor([base] + [base + 1] * 4), first).logits
    runner.reset()
    runner.forward(prompt)
    late = torch.eye(5, dtype=torch.bool)
    late[:4, 4] = True  # the same rows, the root last
    before = runner.forward([*window, root], torch.tensor([base + 1] * 4 + [base]), late).logits
    assert torch.equal(before, torch.cat([after[1:], after[:1]]))


def test_a_failed_capture_leaves_the_same_forward_without_graphs(tiny, monkeypatch, capsys):
    runner = Runner(tiny("llama").model, "graph")
    ids = list(range(2, 40))
    plain = runner.forward(ids).logits
    runner.reset()

    def refuse(cache, span):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner.decoder, "capture", True)
    monkeypatch.setattr(runner.decoder, "_capture", refuse)
    assert torch.equal(runner.forward(ids).logits, plain)
    assert runner.decoder.capture is False
    assert "no CUDA graphs (operation not permitted" in capsys.readouterr().err


class OnlyParts:
    """A `StaticDecoder` seen through `decoder.DecoderParts` alone: reading anything else of it fails."""

    def __init__(self, inner):
        from draftverify.backend.decoder import DecoderParts

        self._inner = inner
        self._names = set(DecoderParts.__annotations__) | {n for n in vars(DecoderParts) if not n.startswith("_")}

    def __getattr__(self, name):
        if name not in self._names:
            raise AssertionError(f"the graph backend read {name!r}, which DecoderParts does not declare")
        return getattr(self._inner, name)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_graph_backend_reads_the_static_decoder_only_through_its_declared_parts(tiny, monkeypatch, arch):
    """backend/graphed.py uses `DecoderParts` and nothing else of the static decoder (a tree, and a layer-skipping
    draft's forward, included), with the bits of the decoder read whole."""
    from draftverify.drafters.skipsets import SkipSet

    model = tiny(arch).model
    whole = Runner(model, "graph")
    static = graphed.StaticDecoder
    monkeypatch.setattr(graphed, "StaticDecoder", lambda *a: OnlyParts(static(*a)))
    parts = Runner(model, "graph")
    assert isinstance(parts.decoder.inner, OnlyParts)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    skip = SkipSet(attention=(0,), mlp=(1,))
    for feed in (
        {"tokens": list(range(2, 30))},
        {"tokens": [7, 8, 9], "tree_mask": tree, "positions": torch.tensor([28, 29, 29])},
        {"tokens": [11], "skip": skip},
    ):
        assert torch.equal(parts.forward(**feed).logits, whole.forward(**feed).logits), feed
