"""Weights rounded as llama.cpp quantizes them, for the tests of the quantized product and the quantized static
path: `quantized` blocks, a tiny GGUF-style Llama, and the check that a stacked forward gives each sequence the bits
it gets alone."""

from __future__ import annotations

import torch
from conftest import make_model

from draftverify.backend import Feed
from draftverify.models import forward_many


def quantized(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` rounded as llama.cpp quantizes it (Q4_1 or Q8_0 blocks of 32, fp16 scales), dequantized to fp32."""
    b = w.reshape(w.shape[0], -1, 32)
    if kind == "q8_0":
        d = (b.abs().amax(-1) / 127).half().float()
        return (torch.round(b / d.clamp_min(1e-30)[..., None]).clamp(-127, 127) * d[..., None]).reshape(w.shape)
    lo = b.amin(-1)
    d, m = ((b.amax(-1) - lo) / 15).half().float(), lo.half().float()
    q = torch.round((b - lo[..., None]) / d.clamp_min(1e-30)[..., None]).clamp(0, 15)
    return (q * d[..., None] + m[..., None]).reshape(w.shape)


def gguf_style_llama():
    """A tiny Llama whose weights are exact Q4_1 (layers) and Q8_0 (embeddings, tied head) blocks, as a GGUF model
    loads."""
    model = make_model("llama", 0, layers=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(quantized(p, "q8_0" if "embed" in name or "lm_head" in name else "q4_1"))
    return model


def assert_stacked_is_alone(alone: list, stacked: list, steps: list[list[dict]]) -> None:
    """Each step's feeds (one per sequence) run alone on `alone`'s runners and stacked in one forward on
    `stacked`'s: the same logits, and at the end the same caches, bit for bit."""
    for feeds in steps:
        want = [r.forward(**f) for r, f in zip(alone, feeds)]
        got = forward_many(stacked, [Feed(**f) for f in feeds])
        for r, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w.logits, g.logits), (feeds, r)
    for a, b in zip(alone, stacked):
        for (ka, va), (kb, vb) in zip(a.cached_kv(), b.cached_kv()):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
