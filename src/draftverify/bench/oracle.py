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
"""

from __future__ import annotations

import time

import torch

from draftverify.models import Runner

WIDTHS = (1, 2, 4, 8, 16)
TEACHER_CHUNK = 256  # tokens per teacher-forced draft forward (bounds the logits' memory)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_forward_times(
    model: torch.nn.Module, context: list[int], widths=WIDTHS, reps: int = 5, all_logits: bool = True
) -> dict[int, float]:
    """Seconds of one forward of w new tokens after `context`, for each w in `widths`: the
    fastest of `reps` runs (the least disturbed by the rest of the machine).

    `all_logits`: compute logits for every new token (the target verifying drafts) or only
    the last one (the draft proposing).
    """
    runner = Runner(model)
    runner.forward(context, last=1)
    base = runner.length
    tokens = (context * (max(widths) // max(1, len(context)) + 1))[: max(widths)]
    times = {}
    for w in widths:
        samples = []
        for rep in range(reps + 1):  # the first run of each width is a warm-up
            _sync(runner.device)
            t = time.perf_counter()
            runner.forward(tokens[:w], last=None if all_logits else 1)
            _sync(runner.device)
            if rep:
                samples.append(time.perf_counter() - t)
            runner.crop(base)
        times[w] = min(samples)
    return times


def forward_time(table: dict[int, float], width: int) -> float:
    """t(width) from a table of measured widths: linear between points, extended linearly beyond."""
    points = sorted((int(w), t) for w, t in table.items())
    if len(points) == 1:
        return points[0][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if width <= w1 or (w1, t1) == points[-1]:
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
    raise AssertionError("unreachable")


def teacher_forced_disagreements(model: torch.nn.Module, prompt: list[int], output: list[int]) -> tuple[list[int], float]:
    """Positions i (1-based) where the draft's greedy token given prompt + X_<i differs from X_i,
    and the seconds of the draft's forward over the prompt."""
    runner = Runner(model)
    _sync(runner.device)
    t = time.perf_counter()
    logits = runner.forward(prompt, last=1).logits  # [1, V]: Y_1
    _sync(runner.device)
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


def oracle_times(n: int, disagreements: list[int], prefill_s: float, draft_prefill_s: float, costs: dict) -> tuple[float, float]:
    """(T_oracle, T_AR) in seconds for one request, by the cost model above."""
    target, draft = costs["target"], costs["draft"]
    rounds = oracle_rounds(n, disagreements)
    t_oracle = prefill_s + draft_prefill_s + sum((m - 1) * forward_time(draft, 1) + forward_time(target, m) for m in rounds)
    t_ar = prefill_s + max(0, n - 1) * forward_time(target, 1)
    return t_oracle, t_ar
