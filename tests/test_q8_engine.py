"""The q8 arithmetic in an engine: every method greedy-identical to autoregressive decoding in q8."""

import copy
from types import SimpleNamespace

import pytest
import torch
from quantized_models import quantized

from draftverify.engine import Engine
from draftverify.errors import DraftVerifyError
from draftverify.kernels import cpu
from draftverify.loading import Loaded

pytestmark = pytest.mark.skipif(cpu() is None, reason="the compiled CPU kernels are unavailable")


def q4_1(loaded: Loaded) -> Loaded:
    """The tiny model with every 2-D linear weight rounded to exact Q4_1 blocks (what a GGUF file holds)."""
    model = copy.deepcopy(loaded.model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.shape[1] % 32 == 0:
            module.weight.data = quantized(module.weight.data, "q4_1")
    return Loaded(model, loaded.tokenizer, name=loaded.name + "-q4_1")


def test_q8_methods_match_q8_autoregressive(tiny):
    target, draft = q4_1(tiny("llama", seed=0)), q4_1(tiny("llama", seed=1, layers=2))
    engine = Engine(target, draft, backend="static", arithmetic="q8")
    assert engine.arithmetic == "q8"
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    ref = engine.generate(prompt, "autoregressive", max_new_tokens=24).tokens
    for method in ("speculative", "prompt-lookup", "lookahead"):
        assert engine.generate(prompt, method, max_new_tokens=24).tokens == ref, method
    fp32 = Engine(target, draft, backend="static", arithmetic="fp32")
    assert fp32.arithmetic == "fp32"
    # q8 keeps the target's keys and values in fp16; fp32 keeps transformers' float32 cache
    assert engine.target_runner.cache.dtype == torch.float16 and fp32.target_runner.cache.dtype == torch.float32


def test_q8_needs_block_weights(tiny):
    with pytest.raises(DraftVerifyError, match="block weights"):
        Engine(tiny("llama", seed=0), None, backend="static", arithmetic="q8")


def test_q8_sampling_matches_q8_target_distribution(tiny):
    """Speculative sampling's second token (the first one verified) follows the q8 target's exact marginal
    sum_x1 p(x1) p(x2 | x1), with p from the q8 runner; negative control: the first token's law is rejected."""
    import numpy as np
    from scipy.stats import chisquare

    from draftverify.sampling import Sampling

    target = q4_1(tiny("llama", seed=0, layers=2, hidden=32))
    engine = Engine(target, q4_1(tiny("llama", seed=3, layers=1, hidden=32)), backend="static", arithmetic="q8")
    assert engine.arithmetic == "q8"
    runner, prompt, sampling = engine.target_runner, [5, 6, 7], Sampling(temperature=1.0, top_k=8)

    def probs(ids):
        runner.reset()
        out = sampling.probs(runner.forward(ids).logits[-1]).double()
        runner.reset()
        return out

    p1 = probs(prompt)
    p2 = sum(p1[x1] * probs(prompt + [x1]) for x1 in p1.nonzero().flatten().tolist())
    support, n = (p2 > 0).nonzero().flatten().tolist(), 2000
    counts = dict.fromkeys(support, 0)
    for seed in range(n):
        r = engine.generate(
            prompt, "speculative", max_new_tokens=3, temperature=1.0, top_k=8, seed=seed, eos_token_id=[],
            policy="constant", k=3,
        )  # fmt: skip
        counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
    observed = np.array([counts[t] for t in support])
    assert sum(counts.values()) == observed.sum()  # no token outside the q8 target's support
    expected = p2[support].numpy()
    assert chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3
    wrong = p1[support].numpy() + 1e-3  # the first token's law: a different distribution
    assert chisquare(observed, wrong / wrong.sum() * n).pvalue < 1e-3


def test_q8_layers_in_one_region_give_the_op_by_op_bits_on_any_number_of_threads(tiny, monkeypatch):
    """A short q8 forward runs every layer in one call and one parallel region (csrc/region.cpp `LayerStack`: rows,
    tiles and attention's tasks shared out between the threads), or a layer a call (`layer`) where the stack cannot
    be used. On one thread, two or three, alone and stacked, over a context of several attention chunks, with a
    draft's skipped sub-layers or none, both give the logits and cache of the op-by-op layers bit for bit."""
    from quantized_models import assert_stacked_is_alone

    from draftverify.backend.linear import Packs
    from draftverify.drafters.skipsets import SkipSet
    from draftverify.models import Runner, Shared

    target = q4_1(tiny("llama", seed=0))
    make = lambda: Runner(target.model, shared=Shared(packs=Packs("q8")))  # noqa: E731
    threads = torch.get_num_threads()
    prompt = [(7 * i) % 90 + 3 for i in range(150)]  # prefilled op by op: past 128 keys, two chunks
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    feeds = [{"tokens": [11]}, {"tokens": [12, 13, 14, 15], "tree_mask": tree}, {"tokens": list(range(20, 28))}]
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            stacked, layered, plain = make(), make(), make()
            stack, calls = stacked.static.stack, []
            assert stack is not None and all(int(layer.fused[0][0][0]) == 1 for layer in stacked.static.layers)
            counting = SimpleNamespace(forward=lambda *a: calls.append(1) or stack.forward(*a))
            monkeypatch.setattr(stacked.static, "stack", counting)
            layered.static.stack = plain.static.stack = None
            for layer in plain.static.layers:
                layer.fused = None
            for feed in ({"tokens": prompt}, *feeds):
                want = plain.forward(**feed).logits
                for runner in (stacked, layered):
                    assert torch.equal(runner.forward(**feed).logits, want), (t, feed)
            assert len(calls) == len(feeds)  # each short forward: one call for all the layers
            for skip in (SkipSet(attention=(1,)), SkipSet(mlp=(0, 2)), SkipSet((0, 3), (0,))):  # a draft's skips
                want = plain.forward([31, 32], skip=skip).logits
                assert torch.equal(stacked.forward([31, 32], skip=skip).logits, want), (t, skip)
                for runner in (stacked, plain):
                    runner.crop(runner.length - 2)
            for runner in (stacked, layered):
                for (ka, va), (kb, vb) in zip(runner.cached_kv(), plain.cached_kv()):
                    assert torch.equal(ka, kb) and torch.equal(va, vb)
            prompts = [prompt, prompt[:40], prompt[:3]]
            alone, together = [make() for _ in prompts], [make() for _ in prompts]
            assert_stacked_is_alone(alone, together, [[{"tokens": p} for p in prompts], feeds])
    finally:
        torch.set_num_threads(threads)
