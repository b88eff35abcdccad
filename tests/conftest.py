"""Shared fixtures: tiny random fp32 models of several architectures with a character
tokenizer, the serve tests' target and draft (`models`) with an engine for their offline outputs (`offline`),
and the real default model (SmolLM2-135M-Instruct) for the slow tests."""

from __future__ import annotations

import functools
import os
import string

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cores_per_worker() -> int:
    """The cores this test process may use: the machine's, shared out among pytest-xdist's workers
    (`scripts/test.sh` runs one per core, at most 4): two workers each running two threads on two
    cores would spin against each other."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:  # the processes tests start get the worker's share too
    os.environ.setdefault("OMP_NUM_THREADS", str(_cores_per_worker()))


# The files that take longest, longest first (`--durations=0`, summed by file). `scripts/test.sh` deals whole files
# to its workers in collection order, so these go out first and no worker is left running a long file alone at
# the end; the rest keep pytest's order. The files split out of a long one stand where it stood.
LONGEST_FILES = ("test_specdec.py", "test_specdec_training.py", "test_specdec_feature_head.py", "test_draft_vocab.py",
                 "test_smollm.py", "test_backends.py", "test_cpu_kernels.py", "test_quantized_forward.py",
                 "test_ouroboros.py", "test_feature_head.py", "test_feature_head_drafting.py",
                 "test_sampling_exact.py", "test_self_speculative.py", "test_equivalence.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _threads(request):
    """One thread for tiny models (thread hand-offs dominate their tiny matmuls, badly so on a busy
    machine), this worker's cores (at most 2) for tests of the real model."""
    torch.set_num_threads(min(2, _cores_per_worker()) if "smollm" in request.fixturenames else 1)


@pytest.fixture(scope="session", autouse=True)
def _curves_of_this_session(tmp_path_factory):
    """Engines keep their cost curves in a folder of this test session (costs.cache_folder), not the user's cache:
    a curve measured on a busy machine would otherwise steer later runs' draft lengths. Session-wide, so that the
    engines of module fixtures, made before any test's own fixtures, keep theirs there too (they wrote to the
    user's cache before). Two engines need not read one curve (a server measures in its own thread, with that
    thread's torch thread count in the curve's key), so a test that compares seeded sampling between engines
    drafts at a constant length (test_serve). test_costs_cache.py points the folder at a temporary one of each test.
    The test workers keep each other's CPUs busy, so a curve would never count as measured on a quiet machine
    (costs.busy.BUSY_SHARE): in this throwaway folder each is kept, as before that check. And engines measure
    their curves in full (`Shared.full_curves`), as the bench does: a tiny model's forwards take a fraction of a
    millisecond, and a quick curve's two timed runs a width would read the busy machine's hiccups of several;
    test_costs_quick.py tests the quick curves an engine measures by default."""
    from draftverify import costs, engine

    folder = tmp_path_factory.mktemp("curves")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costs, "cache_folder", lambda: folder)
        patch.setattr(costs.busy, "BUSY_SHARE", 1.0)
        patch.setattr(engine, "Shared", functools.partial(engine.Shared, full_curves=True))
        yield


ARCHS = ("llama", "gpt2", "qwen2", "gpt_neox")
# Sliding-window and hybrid (sliding + full layers) decoders, windows far shorter than the test
# sequences (Phi-3: fused qkv and gate/up, one window for every layer); plus Qwen3 (per-head q/k norms).
# Used by test_backends.py and test_recipes.py.
WINDOW = 6
SLIDING_ARCHS = ("mistral", "qwen2-sliding", "gemma2", "gemma3", "phi3")
STATIC_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen2-sliding", "gemma2", "gemma3", "phi3")
CHARS = string.ascii_letters + string.digits + " .,;:!?'\"-\n()[]{}=+*/<>#_"


def make_tokenizer():
    """A real fast tokenizer over single characters (vocab ~100), with an EOS token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    return fast


def tiny_config(arch: str, layers: int, hidden: int, vocab: int, window: int):
    """The transformers config of a tiny model of `arch` (4 heads, 2 KV heads where the architecture has them)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=vocab, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    sizes = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4)
    attn = dict(sizes, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":
        return LlamaConfig(**attn, **common)
    if arch == "qwen2":
        return Qwen2Config(**attn, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden // 4, **attn, **common)
    if arch == "mistral":  # every layer slides
        return MistralConfig(sliding_window=window, **attn, **common)
    if arch == "qwen2-sliding":  # full layers first, sliding above max_window_layers
        return Qwen2Config(
            use_sliding_window=True, sliding_window=window, max_window_layers=layers // 2, **attn, **common
        )
    if arch in ("gemma2", "gemma3"):  # sliding and full layers alternate
        Config = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
        types = ["sliding_attention", "full_attention"] * layers
        return Config(
            head_dim=hidden // 4,
            sliding_window=window,
            query_pre_attn_scalar=hidden // 4,
            layer_types=types[:layers],
            **attn,
            **common,
        )
    if arch == "phi3":  # fused qkv_proj and gate_up_proj; every layer slides
        return Phi3Config(sliding_window=window, **attn, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(**sizes, max_position_embeddings=512, **common)
    raise ValueError(arch)


def make_model(
    arch: str = "llama", seed: int = 0, layers: int = 4, hidden: int = 64, vocab: int = 100, window: int = WINDOW
):
    """A tiny random fp32 causal LM of the given architecture (sdpa attention)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, layers, hidden, vocab, window)
    impl = "eager" if arch == "gemma2" else "sdpa"  # transformers runs Gemma 2 (soft-capping) eagerly only
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
    # Random init gives near-uniform logits; sharpen them so greedy argmaxes are well separated.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
            elif "norm" in name and arch in ("gemma2", "gemma3", "phi3"):  # norms off their init (Gemma: 1 + w)
                p.add_(0.3 * torch.randn_like(p))
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny(tokenizer):
    """Factory: tiny(arch, seed=0, layers=4) -> Loaded (cached per arguments)."""
    from draftverify.loading import Loaded

    cache = {}

    def build(arch: str = "llama", seed: int = 0, layers: int = 4, hidden: int = 64):
        key = (arch, seed, layers, hidden)
        if key not in cache:
            cache[key] = Loaded(make_model(arch, seed, layers, hidden), tokenizer, name=f"tiny-{arch}-{seed}")
        return cache[key]

    return build


@pytest.fixture(scope="module")
def models(tiny):
    """The serve tests' (target, draft): tiny llamas, the draft of another seed and half the layers."""
    return tiny("llama"), tiny("llama", seed=1, layers=2)


@pytest.fixture(scope="module")
def offline(models):
    """An engine of its own (own caches, apart from the served engine's) for the serve tests' expected outputs."""
    from draftverify import Engine

    return Engine(*models)


@pytest.fixture(scope="session")
def smollm():
    """The real default target (SmolLM2-135M-Instruct, fp32 on CPU)."""
    from draftverify.loading import load_model

    return load_model(device="cpu", dtype="fp32")


def give_curve(engine, costs: dict | None) -> None:
    """The engine holds `costs` as its target's cost curve (none: no curve at all)."""
    from draftverify.costs import Curve
    from draftverify.drafters.feature import TREE_WIDTHS

    engine.shared.curves.clear()
    if costs is not None:
        runner = engine.target_runner
        engine.shared.curves[runner.model] = {(runner.backend, runner.draft, True, TREE_WIDTHS): Curve(costs, 0)}
