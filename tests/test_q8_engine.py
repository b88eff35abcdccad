"""The q8 arithmetic in an engine: every method greedy-identical to autoregressive decoding in q8."""

import copy

import pytest
import torch
from test_backends import quantized

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


def test_q8_needs_block_weights(tiny):
    with pytest.raises(DraftVerifyError, match="block weights"):
        Engine(tiny("llama", seed=0), None, backend="static", arithmetic="q8")
