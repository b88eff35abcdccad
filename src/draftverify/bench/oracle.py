"""How far from the limit: the SpecDec++ hindsight oracle and a forward-time cost model.

SpecDec++ (Huang et al. 2024), Lemma 2.1: given the target's output X_1..X_N and the
draft's greedy tokens Y_i = argmax q(. | prompt, X_<i) (teacher forcing), a drafter that
knows the disagreements S = {i : Y_i != X_i} stops every round just before one, so no draft
token is discarded and the target runs |S| + 1 forwards.

Here the first token always comes from the target's prefill (as in every method of this
library), so position 1 counts as a disagreement, and the last round ends at N:
    round ends  E = ({i in 2..N : Y_i != X_i} | {N}) for N >= 2, else {}
    N_target    = 1 + |E|                     (the prefill, then one forward per round)
    round j covering positions a..b emits b - a + 1 tokens: b - a drafted, 1 from the target.

Cost model, from forward times measured at the start of the run (t_T(w), t_D(w) = one
target / draft forward of w new tokens after a fixed context; linear between the measured
widths 1, 2, 4, 8, 16 and beyond; each the fastest of 5 runs):
    T_oracle = T_prefill + T_draft_prefill + sum over rounds [ (b - a) t_D(1) + t_T(b - a + 1) ]
    T_AR     = T_prefill + (N - 1) t_T(1)
    oracle speedup = T_AR / T_oracle
with T_prefill = the autoregressive run's time to first token on this prompt (median over
repeats) and T_draft_prefill = the draft's forward over the prompt, timed here.

The ceiling of any drafter on this machine (`chain_factor`, `ceiling_times`): a round that drafts
k tokens, each accepted with probability a (independently, as in Leviathan et al.), at c target
forwards of drafting per drafted token, and verifies them in one forward of k + 1 tokens, costs
r(k + 1) + k c target steps for E_k = 1 + a + ... + a^k tokens on average, r(w) = t_T(w) / t_T(1)
from the curve above. The best k (k = 0: plain decoding) gives the time per token as a fraction
of a step,
    g(a, c)     = min over k in 0..K of (r(k + 1) + k c) / E_k      (K + 1 = the widest forward timed)
and with the prompt's forward unchanged,
    T(a, c)     = T_prefill + (N - 1) s g(a, c),   T_AR = T_prefill + (N - 1) s
where s = the autoregressive run's own mean step on this prompt ((wall - ttft) / (N - 1), so a long
prompt's dearer steps count). g(1, 0) = min_w r(w) / w is a draft that is always right and free:
no lossless drafter beats T_AR / T(1, 0) on that prompt (the curve is measured after 128 tokens
of context; after more, wide forwards cost relatively more, so the bound is generous there).
"""

from __future__ import annotations

import time

import torch

from draftverify.costs import forward_time, sync_device
from draftverify.models import Runner

TEACHER_CHUNK = 256  # tokens per teacher-forced draft forward (bounds the logits' memory)


def teacher_forced_disagreements(
    model: torch.nn.Module, prompt: list[int], output: list[int]
) -> tuple[list[int], float]:
    """Positions i (1-based) where the draft's greedy token given prompt + X_<i differs from X_i,
    and the seconds of the draft's forward over the prompt."""
    runner = Runner(model)
    sync_device(runner.device)
    t = time.perf_counter()
    logits = runner.forward(prompt, last=1).logits  # [1, V]: Y_1
    sync_device(runner.device)
    prefill_s = time.perf_counter() - t
    guesses = [int(logits[-1].argmax())]
    for start in range(0, len(output) - 1, TEACHER_CHUNK):
        chunk = output[start : min(start + TEACHER_CHUNK, len(output) - 1)]
        guesses += runner.forward(chunk).logits.argmax(-1).tolist()  # [len(chunk)]: Y_{start+2}..
    return [i + 1 for i, (y, x) in enumerate(zip(guesses, output)) if y != x], prefill_s


def oracle_rounds(n: int, disagreements: list[int]) -> list[int]:
    """Tokens emitted by each oracle round after the prefill (each = drafted + 1)."""
    if n < 2:
        return []
    ends = sorted({i for i in disagreements if 2 <= i <= n} | {n})
    rounds, start = [], 2
    for end in ends:
        rounds.append(end - start + 1)
        start = end + 1
    return rounds


def oracle_times(
    n: int, disagreements: list[int], prefill_s: float, draft_prefill_s: float, costs: dict
) -> tuple[float, float]:
    """(T_oracle, T_AR) in seconds for one request, by the cost model above."""
    target, draft = costs["target"], costs["draft"]
    rounds = oracle_rounds(n, disagreements)
    t_oracle = (
        prefill_s + draft_prefill_s + sum((m - 1) * forward_time(draft, 1) + forward_time(target, m) for m in rounds)
    )
    t_ar = prefill_s + max(0, n - 1) * forward_time(target, 1)
    return t_oracle, t_ar


def chain_factor(curve: dict[int, float], acceptance: float, draft_cost: float) -> float:
    """g(a, c) above: the fewest target steps per token a chain drafter with per-token `acceptance` and
    `draft_cost` (target forwards per drafted token) reaches on `curve`, drafting at best length (1 = none)."""
    t1, widest = forward_time(curve, 1), max(int(w) for w in curve)  # keys may be text (JSON)
    best, expected = 1.0, 1.0
    for k in range(1, widest):
        expected += acceptance**k
        best = min(best, (forward_time(curve, k + 1) / t1 + k * draft_cost) / expected)
    return best


def ceiling_times(n: int, prefill_s: float, wall_s: float, factor: float) -> float:
    """T(a, c) above for one request of `n` tokens whose autoregressive run took `wall_s`, `prefill_s` of it
    to the first token; `factor` = chain_factor(...)."""
    return prefill_s + (wall_s - prefill_s) * factor if n > 1 else wall_s
