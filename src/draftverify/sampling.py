"""Sampling controls shared by draft and target, so that rejection sampling stays exact.

Both models' logits go through the same `Sampling.probs` (temperature, then min-p, then top-k,
then top-p, then softmax); the verifier compares the resulting distributions q (draft) and
p (target). temperature == 0 means greedy decoding: verification compares argmaxes. What depends
on the tokens so far (penalties, logit_bias, a grammar) is applied before, by `logits.Processor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftverify.errors import require


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off: keep tokens at least min_p times as likely as the likeliest
    seed: int | None = None

    def __post_init__(self):
        require(
            self.temperature >= 0, f"temperature={self.temperature} is negative: use 0 (greedy) or a positive value"
        )
        require(0 < self.top_p <= 1, f"top_p={self.top_p} is outside (0, 1]: use e.g. 0.9, or 1 to turn it off")
        require(0 <= self.min_p <= 1, f"min_p={self.min_p} is outside [0, 1]: use e.g. 0.05, or 0 to turn it off")
        require(self.top_k >= 0, f"top_k={self.top_k} is negative: use 0 to turn it off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator for one request (seeded when a seed is given)."""
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probabilities [..., V] (fp32) after temperature, top-k and top-p."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        # Shift by the max first: a tiny temperature (1e-40) then sends the others to -inf, not inf - inf = NaN.
        logits = (logits - logits.amax(-1, keepdim=True)) / self.temperature
        if self.min_p > 0:  # the max is 0 now: p / p_max < min_p  <=>  logit < log(min_p)
            logits = logits.masked_fill(logits < math.log(self.min_p), float("-inf"))
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            logits = logits.masked_fill(~self._nucleus(logits.softmax(-1)), float("-inf"))
        return logits.softmax(-1)

    def _nucleus(self, probs: torch.Tensor) -> torch.Tensor:
        """The top-p set of probs [..., V] (True = kept): the likeliest tokens, in order, while the mass ranked
        ahead of a token is below top_p. Read from the k likeliest only, k growing until the set ends inside
        them (a handful of tokens for a peaked distribution): sorting the whole vocabulary per row costs far more."""
        v = probs.shape[-1]
        k = min(64, v)
        while True:
            top, order = probs.topk(k, dim=-1)  # descending
            ahead = top.cumsum(-1) - top
            if k == v or bool((ahead[..., -1] >= self.top_p).all()):  # every row's set ends before its k-th token
                return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, ahead < self.top_p)
            k = 8 * k if 8 * k <= v // 4 else v  # past a quarter of the vocabulary, read it all


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
