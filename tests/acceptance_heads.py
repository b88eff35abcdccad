"""What the SpecDec++ tests share: acceptance heads made for a pair (`random_head`, `scripted_head`), a noisy copy
of a model, `specdec-pp`'s greedy equality to autoregressive decoding and the chi-square test of its second new
token."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
from scipy.stats import chisquare

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, save_head
from draftverify.loading import Loaded
from draftverify.sampling import Sampling


def random_head(path: Path, target: Loaded, draft: Loaded, depth: int = 1, seed: int = 0) -> Path:
    """An untrained head for the pair: its predictions vary with the hidden state, so draft lengths vary."""
    torch.manual_seed(seed)
    head = AcceptanceHead(draft.model.config.hidden_size, depth)
    return save_head(path, head, draft.identity, target.identity)


def scripted_head(hidden_size: int = 1) -> AcceptanceHead:
    """D = 0, weight e_0, bias 0: p_hat = sigmoid(e[0]), so a hidden state [logit(p)] scripts p_hat = p."""
    head = AcceptanceHead(hidden_size, depth=0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.weight[0, 0] = 1.0
        head.out.bias.zero_()
    return head


def logit(p: float) -> torch.Tensor:
    return torch.tensor([math.log(p / (1 - p))])


def noisy_copy(model: Loaded, scale: float, seed: int = 5) -> Loaded:
    """The target with noise on its matrices: a draft that agrees with it part of the time."""
    m = copy.deepcopy(model.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return Loaded(m, model.tokenizer, f"{model.name}+noise")


def assert_equals_autoregressive(engine: Engine, head: Path, *label):
    """`specdec-pp` with `head`, at two settings, gives autoregressive decoding's tokens on two prompts; returns
    its last output."""
    for prompt in ["Hello there, how", "def f(x):\n    return"]:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=32, eos_token_id=[])
        for options in ({"h": 0.2}, {"h": 0.8, "cap": 3}):
            out = engine.generate(
                ids, method="specdec-pp", max_new_tokens=32, eos_token_id=[], head=str(head), **options
            )
            assert out.tokens == ar.tokens, (*label, prompt, options)
    return out


def second_token_pvalue(engine: Engine, target: Loaded, head: Path, n: int) -> float:
    """Chi-square p-value of the second new token (the first that goes through verification)
    against the target's exact marginal sum_x1 p(x1) p(x2 | x1); rare tokens are pooled."""
    prompt = [5, 6, 7]
    sampling = Sampling(temperature=1.0, top_k=8)
    with torch.no_grad():
        p1 = sampling.probs(target.model(torch.tensor([prompt])).logits[0, -1]).double()
        p2 = torch.zeros_like(p1)
        for x1 in p1.nonzero().flatten().tolist():
            p2 += p1[x1] * sampling.probs(target.model(torch.tensor([prompt + [x1]])).logits[0, -1]).double()
    counts = torch.zeros_like(p2)
    for seed in range(n):
        out = engine.generate(
            prompt,
            method="specdec-pp",
            max_new_tokens=3,
            temperature=1.0,
            top_k=8,
            seed=seed,
            eos_token_id=[],
            head=str(head),
            h=0.5,
            cap=4,
        )
        counts[out.tokens[1]] += 1
    expected = p2 * n
    big = expected >= 5
    observed, rest = counts[big].numpy(), expected[~big].sum().item()
    assert counts[expected == 0].sum() == 0, "a token the target never samples was emitted"
    if rest > 0:  # pool the rare tokens into one cell (none when every possible token is common)
        observed = np.append(observed, counts[~big].sum().item())
    expected = expected[big].numpy() if rest == 0 else np.append(expected[big].numpy(), rest)
    return chisquare(observed, expected / expected.sum() * observed.sum()).pvalue
