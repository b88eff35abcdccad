"""Layer skipping: the context manager, drafting with a skip set in a runner's cache, skip-set files and strategies."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHS

from draftverify.drafters.skipsets import (
    SkipSet,
    load_skip_set,
    make_skip_set,
    save_skip_set,
    skip_layers,
    sublayer_names,
)
from draftverify.errors import DraftVerifyError
from draftverify.loading import decoder_layers
from draftverify.models import Runner

IDS = torch.tensor([[5, 17, 9, 33, 2, 41, 8]])


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_skipping_nothing_is_exact_and_skipping_changes_logits(tiny, arch):
    model = tiny(arch).model
    full = logits(model)
    with skip_layers(model, SkipSet()):
        assert torch.equal(logits(model), full)
    for skip in (SkipSet(attention=(1,)), SkipSet(mlp=(2,)), SkipSet((0,), (0,))):
        with skip_layers(model, skip):
            assert not torch.allclose(logits(model), full, atol=1e-4), skip
    assert torch.equal(logits(model), full)  # restored


@pytest.mark.parametrize("arch", ARCHS)
def test_skipped_sublayer_adds_nothing_to_the_residual(tiny, arch):
    """Skipping both sub-layers of layer i makes layer i the identity: its input hidden state passes through."""
    model = tiny(arch).model
    layer = decoder_layers(model)[1]
    seen = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, kw: seen.update(x=(args[0] if args else kw["hidden_states"]).clone()), with_kwargs=True
        ),
        layer.register_forward_hook(
            lambda m, args, kw, out: seen.update(y=(out[0] if isinstance(out, tuple) else out).clone()),
            with_kwargs=True,
        ),
    ]
    try:
        with skip_layers(model, SkipSet((1,), (1,))):
            logits(model)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(seen["x"], seen["y"])


def test_modules_are_restored_after_an_exception(tiny):
    model = tiny("llama").model
    layers = decoder_layers(model)
    before = [(layer.self_attn, layer.mlp) for layer in layers]
    with pytest.raises(RuntimeError, match="boom"):
        with skip_layers(model, SkipSet((0, 2), (1, 3))):
            assert layers[0].self_attn is not before[0][0]
            raise RuntimeError("boom")
    assert [(layer.self_attn, layer.mlp) for layer in layers] == before


def test_sublayer_names_per_architecture(tiny):
    expected = {
        "llama": ("self_attn", "mlp"),
        "qwen2": ("self_attn", "mlp"),
        "gpt2": ("attn", "mlp"),
        "gpt_neox": ("attention", "mlp"),
    }
    for arch, names in expected.items():
        assert sublayer_names(decoder_layers(tiny(arch).model)[0]) == names


def test_unsupported_layer_and_nesting_are_refused(tiny):
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = torch.nn.Linear(2, 2)

    with pytest.raises(DraftVerifyError, match="cannot skip layers of Odd"):
        sublayer_names(Odd())
    model = tiny("llama").model
    with skip_layers(model, SkipSet((1,), ())):
        with pytest.raises(DraftVerifyError, match="already active"):
            with skip_layers(model, SkipSet((1,), ())):
                pass
    with pytest.raises(DraftVerifyError, match="has 4 layers"):
        with skip_layers(model, SkipSet((4,), ())):
            pass


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_verification_equals_a_plain_forward(tiny, arch):
    """Draft with layer 0's attention skipped (layer lengths diverge), roll back, verify: every layer's
    K/V equals the cache of a plain runner that saw the same tokens in the same chunks."""
    model = tiny(arch).model
    prompt, root, drafts = [5, 17, 9, 33, 2], 41, [8, 12, 3]
    runner = Runner(model, "eager")
    runner.forward(prompt)
    base = runner.length
    for token in [root] + drafts[:-1]:
        runner.forward([token], last=1, skip=SkipSet(attention=(0, 2), mlp=(1,)))
    lengths = [layer.get_seq_length() for layer in runner.cache.store.layers]
    assert lengths[0] == base and lengths[1] == base + len(drafts) and runner.length == base + len(drafts)
    runner.crop(base)
    assert {layer.get_seq_length() for layer in runner.cache.store.layers} == {base}
    verify = runner.forward([root] + drafts).logits
    runner.crop(base + 2)  # accept one draft

    plain = Runner(model, "eager")
    plain.forward(prompt)
    assert torch.equal(plain.forward([root] + drafts).logits, verify)
    plain.crop(base + 2)
    for ours, theirs in zip(runner.cache.store.layers, plain.cache.store.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    one_shot = Runner(model, "eager")
    one_shot.forward(prompt + [root, drafts[0]])
    for ours, theirs in zip(runner.cache.store.layers, one_shot.cache.store.layers):
        assert torch.allclose(ours.keys, theirs.keys, atol=1e-5) and torch.allclose(
            ours.values, theirs.values, atol=1e-5
        )


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_drafting_with_layer0_skipped_matches_the_skipped_model(tiny, backend):
    """Drafting token by token in the shared cache gives the logits of the skipped model run on the whole
    sequence (positions and masks must not come from the stale layer-0 cache). The static backend's
    own skipping agrees with the stock modules swapped out."""
    model = tiny("llama").model
    skip = SkipSet(attention=(0,), mlp=(3,))
    prompt, extra = [5, 17, 9, 33], [2, 41, 8]
    runner = Runner(model, backend)
    runner.forward(prompt)
    steps = [runner.forward([t], last=1, skip=skip).logits[-1] for t in extra]
    # reference: full model on the prompt, skipped model on the new tokens, in a plain (eager) cache
    ref = Runner(model, "eager")
    ref.forward(prompt)
    with skip_layers(model, skip):
        expected = ref.forward(extra).logits
    assert torch.allclose(torch.stack(steps), expected, atol=1e-5)


def test_strategies_skip_the_same_number_of_sublayers():
    n = 30
    for name in ("first", "middle", "last"):
        skip = getattr(SkipSet, name)(n, 7, 3)
        assert (len(skip.attention), len(skip.mlp)) == (7, 3)
    assert SkipSet.first(n, 2, 1) == SkipSet((0, 1), (0,))
    assert SkipSet.last(n, 2, 1) == SkipSet((28, 29), (29,))
    assert SkipSet.middle(n, 2, 1) == SkipSet((14, 15), (14,))
    r = SkipSet.random(n, 7, 3, seed=1)
    assert (len(r.attention), len(r.mlp)) == (7, 3) and r == SkipSet.random(n, 7, 3, seed=1) != SkipSet.random(
        n, 7, 3, seed=2
    )
    h = SkipSet.heuristic(n)
    assert len(h.attention) == 18 and len(h.mlp) == 9 and n - 1 not in h.attention + h.mlp
    assert min(h.mlp) >= n // 2 and min(h.attention) >= n // 4


def test_make_skip_set_takes_counts_from_the_searched_set(tiny):
    model = tiny("llama").model
    searched = SkipSet((1, 2), (3,))
    assert make_skip_set("searched", model, searched) == searched
    assert make_skip_set("first", model, searched) == SkipSet((0, 1), (0,))
    assert make_skip_set("last", model, searched, n_attention=1) == SkipSet((3,), (3,))
    assert make_skip_set("none", model, None) == SkipSet()
    with pytest.raises(DraftVerifyError, match="no searched skip set"):
        make_skip_set("searched", model, None)


def test_skip_file_roundtrip_and_refusals(tiny, tmp_path):
    a, b = tiny("llama", seed=0), tiny("llama", seed=1)
    path = save_skip_set(tmp_path / "skip.json", SkipSet((1,), (2, 3)), a.identity, search={"trials": 3})
    assert not list(tmp_path.glob(".*tmp"))  # written atomically, nothing left behind
    assert load_skip_set(path, a.identity) == SkipSet((1,), (2, 3))
    with pytest.raises(DraftVerifyError, match="made for another model"):
        load_skip_set(path, b.identity)
    with pytest.raises(DraftVerifyError, match="made for another model"):
        load_skip_set(path, tiny("gpt2").identity)
    doc = json.loads(path.read_text())
    (tmp_path / "cut.json").write_text(path.read_text()[:40])
    with pytest.raises(DraftVerifyError, match="corrupt"):
        load_skip_set(tmp_path / "cut.json", a.identity)
    (tmp_path / "floats.json").write_text(json.dumps({**doc, "attention": [1.5]}))
    with pytest.raises(DraftVerifyError, match="corrupt"):
        load_skip_set(tmp_path / "floats.json", a.identity)
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DraftVerifyError, match="not a draftverify skip set"):
        load_skip_set(tmp_path / "other.json")
    (tmp_path / "deep.json").write_text(json.dumps({**doc, "attention": [9]}))
    with pytest.raises(DraftVerifyError, match="has 4 layers"):
        load_skip_set(tmp_path / "deep.json", a.identity)
    with pytest.raises(DraftVerifyError, match="does not exist"):
        load_skip_set(tmp_path / "missing.json")
