"""The settings of a feature head's build (`make-draft --kind head`): what the loss, the batches and the
schedule use, and which of them a resumed build must keep."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.errors import require


@dataclass(frozen=True)
class HeadTraining:
    vocab: int = 8192  # N: the head drafts the N most frequent reply tokens (FR-Spec)
    width: int = 0  # the head's MLP width (0: `head_width`, the widest whose drafts fit PACKAGE_BYTES)
    rollout: int = 3  # training-time test depth (1 = plain teacher forcing, EAGLE-1)
    epochs: float = 8.0  # at most this many passes (feature_schedule: the time left usually ends it sooner)
    batch_tokens: int = 4096  # at most; small data gets smaller batches (feature_schedule.epoch_batch_tokens)
    max_len: int = 384
    lr: float = 1e-3
    warmup: int = 20
    feature_weight: float = 0.1
    seed: int = 0
    budget_minutes: float = 110.0  # data + training wall clock
    data_share: float = 0.6  # part of the budget for making data (the cached data is always used)
    gen_batch: int = 64
    max_new_tokens: int = 96
    max_prompt_tokens: int = 256
    sampled: int = 0  # replies per prompt sampled besides the greedy one (tools.replies.SAMPLED)
    templates: int = (
        0  # more prompts written from the project's stdlib templates (code, summaries, ...), answered greedily
    )
    heldout: int = 64
    checkpoint_minutes: float = 3.0
    steps: int | None = None  # stop after this many optimiser steps (the schedule keeps its length)
    train_dtype: str = (
        "auto"  # the training forward's matmuls: fp32, bf16 (autocast; weights, optimiser, norms fp32) or auto
    )

    def __post_init__(self):
        require(self.vocab >= 16, f"--vocab {self.vocab} must be at least 16")
        require(self.width >= 0, f"width={self.width} must be 0 (automatic) or a positive MLP width")
        require(1 <= self.rollout <= 8, f"rollout={self.rollout} must lie in 1..8")
        require(
            self.epochs > 0 and self.lr > 0 and self.budget_minutes > 0, "epochs, lr and the budget must be positive"
        )
        require(0 <= self.data_share < 1, f"data_share={self.data_share} must lie in [0, 1)")
        require(self.batch_tokens >= self.max_len >= 16, "batch_tokens must be >= max_len >= 16")
        require(self.sampled >= 0, f"--sampled {self.sampled} must be 0 or more")
        require(self.templates >= 0, f"--templates {self.templates} must be 0 or more")
        require(
            self.train_dtype in ("auto", "fp32", "bf16"),
            f"--train-dtype {self.train_dtype!r} is unknown: use auto, fp32 or bf16",
        )

    def autocast_bf16(self) -> bool:
        """Whether the training forward runs its matmuls in bf16: `auto` does where the CPU multiplies bf16 natively."""
        return self.train_dtype == "bf16" or (self.train_dtype == "auto" and native_bf16())


TRAINING_KEYS = (
    "vocab",
    "width",
    "rollout",
    "batch_tokens",
    "max_len",
    "lr",
    "warmup",
    "feature_weight",
    "seed",
)  # what a resumed build must keep
PACKAGE_BYTES = 40_000_000  # a target's drafts as the package ships them: feature head, acceptance head, skip set
PACKAGE_SLACK = 1 << 20  # of which the files' other contents (the head's vocabulary list, cards, the skip set)
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX): only there is a bf16 matmul faster
    than an fp32 one; elsewhere bf16 is emulated."""
    from draftverify.kernels import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def head_width(config, asked: int = 0) -> int:
    """The head's MLP width for a target's config: `asked`, else the target's own, narrowed (in steps of 64) until
    the target's drafts fit PACKAGE_BYTES: the head's fp16 weights beside SpecDec++'s acceptance head for it (one
    fp32 block as wide as the features). A narrower MLP also drafts faster (its weights are read every drafted
    token) and trains faster; the attention and the input layer keep the target's shapes, which the features need."""
    if asked:
        return asked
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads)
    fixed = 2 * h * h + 2 * h * heads * d + 2 * h * kv * d  # fc, q and o, k and v
    acceptance = 4 * (h * h + 2 * h + 1)
    room = ((PACKAGE_BYTES - acceptance - PACKAGE_SLACK) / 2 - fixed) // (3 * h)  # gate, up, down: 3 h a unit
    return int(max(64, min(config.intermediate_size, room // 64 * 64)))
