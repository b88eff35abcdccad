"""Training data for the SpecDec++ acceptance head (Huang et al. 2024, section 3.3, steps 1-3).

1. the target answers the training prompts: X_1..X_N (batched `generate`, cached on disk);
2. on the target's prefix X_<i, the target gives p_i and the draft q_i; Y_i ~ q_i and its label is
   the chance it would be accepted, P_i = min(1, p_i(Y_i) / q_i(Y_i)) (with greedy settings p and
   q are one-hot, so P_i = 1 exactly when the draft's argmax is the target's);
3. the draft reads a mixed response Z: Z_i = X_i for a fraction r of positions, Y_i for the rest
   (the paper's BERT-style mixing, so the draft sees its own tokens as at inference); its final
   hidden state e_i at each position reading a Y_i is one training input, with label P_i.
The answers and the labelled examples are cached under a key of everything they depend on (written atomically).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.drafters.feature import DRAFT_VOCAB
from draftverify.errors import require
from draftverify.feature_head import FeatureHead
from draftverify.loading import Loaded
from draftverify.models import Runner
from draftverify.sampling import Sampling
from draftverify.tools import replies
from draftverify.util import atomic_path, atomic_write
from draftverify.verify import fit_vocab

CHAIN_DEPTH = 8  # a feature head's chains are labelled this deep: past it the head's drafts are seldom still right


@dataclass
class Examples:
    """Training inputs: hidden states e [N, H], labels P [N] and the response each came from [N]."""

    features: torch.Tensor
    labels: torch.Tensor
    response: torch.Tensor


def target_answers(
    target: Loaded,
    prompts: list[tuple[str, bool]],
    sampling: Sampling,
    max_new_tokens: int,
    answer_batch: int = 16,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[list[list[int]], list[list[int]]]:
    """Step 1: the prompts as token ids (chat template where asked) and the target's answers."""
    from draftverify.engine import Engine

    require(max_new_tokens >= 1, f"max_new_tokens={max_new_tokens} must be at least 1")
    engine = Engine(target)
    ids = [engine.encode(text, chat=chat) for text, chat in prompts]
    return ids, answer_prompts(
        target, ids, max_new_tokens, sampling, engine.eos_ids(), answer_batch, cache_dir, progress
    )


def answer_prompts(
    target: Loaded,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: tuple[int, ...],
    batch_size: int = 16,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> list[list[int]]:
    """The target's answers X to each prompt (token ids, cut after the first EOS), cached on disk.

    Batched `generate` with left padding: a batch's step costs less than its rows' steps one by one
    (the weights are read once per step). The answers are training data only, so padding's tiny numerical effects do not
    matter. Finished batches are saved as they come, so an interrupted run resumes.
    """
    key = _key("answers", target.identity, prompts, max_new_tokens, _describe(sampling), eos_ids)
    cached = _read_json(cache_dir, f"answers-{key}.json")
    if cached is not None:
        return cached
    from tqdm import tqdm

    device = target.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    partial = _read_json(cache_dir, f"answers-{key}.partial.json") or {"batch_size": batch_size, "done": {}}
    done = {int(i): a for i, a in partial["done"].items()} if partial["batch_size"] == batch_size else {}
    todo = [rows for rows in batches if not all(i in done for i in rows)]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed((sampling.seed or 0) + len(batches) - len(todo))  # `generate` samples from the global one
        already = len(batches) - len(todo)
        for rows in tqdm(todo, "target answers", len(batches), disable=not progress, unit="batch", initial=already):
            out = _generate([prompts[i] for i in rows], target, eos_ids, max_new_tokens, sampling)
            done.update(zip(rows, out))
            _write_json(cache_dir, f"answers-{key}.partial.json", {"batch_size": batch_size, "done": done})
    answers = [done[i] for i in range(len(prompts))]
    _write_json(cache_dir, f"answers-{key}.json", answers)
    if cache_dir is not None:
        (cache_dir / f"answers-{key}.partial.json").unlink(missing_ok=True)
    return answers


def _generate(
    prompts: list[list[int]], target: Loaded, eos_ids: tuple[int, ...], max_new_tokens: int, sampling: Sampling
) -> list[list[int]]:
    """One left-padded batch through `generate` (`tools.replies`): each prompt's answer, cut after its first EOS."""
    sample = None
    if not sampling.greedy:
        sample = {"temperature": sampling.temperature, "top_k": sampling.top_k or None, "top_p": sampling.top_p}
    got = replies.answer(target, prompts, max_new_tokens, sample)
    return [replies.cut_after_eos(reply, eos_ids) for reply in got.replies]


# -- labels and mixing ------------------------------------------------------------------------


def acceptance_labels(
    p: torch.Tensor,  # [n, V] target distributions p_i on the target's prefix
    q: torch.Tensor,  # [n, V] draft distributions q_i on the same prefix
    y: torch.Tensor,  # [n] Y_i ~ q_i
) -> torch.Tensor:
    """P_i = min(1, p_i(Y_i) / q_i(Y_i)): the chance that speculative sampling accepts Y_i. [n]"""
    py = p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    qy = q.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (py / qy).clamp(max=1.0)


def mix_tokens(
    x: torch.Tensor,  # [n] the target's tokens X_i
    y: torch.Tensor,  # [n] the draft's tokens Y_i
    r: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Z [n] taking X_i with probability r and Y_i otherwise, and which positions hold Y_i [n] bool."""
    from_draft = torch.rand(x.shape, generator=generator, device=generator.device) >= r
    return torch.where(from_draft, y, x), from_draft


def label_responses(
    target: Runner,
    draft: Runner,
    prompts: list[list[int]],
    answers: list[list[int]],
    sampling: Sampling,
    r: float,
    seed: int,
    progress: bool = True,
    greedy_answers: bool = False,
) -> Examples:
    """Steps 2-3 for every (prompt, answer): the head's inputs e_i and labels P_i at the draft positions.

    `greedy_answers`: the answers are the target's greedy output, so with greedy settings the
    label is just whether Y_i (the draft's argmax) equals X_i, and the target is not run again.
    """
    from tqdm import tqdm

    generator = torch.Generator(device=draft.device).manual_seed(seed)
    features, labels, response = [], [], []
    for index, (prompt, answer) in enumerate(
        tqdm(list(zip(prompts, answers)), desc="labelling", unit="answer", disable=not progress)
    ):
        n = len(answer)
        if n == 0:
            continue
        seq = prompt + answer
        x = torch.tensor(answer, device=draft.device)  # [n] X_i
        draft.reset()
        q = sampling.probs(draft.forward(seq, last=n + 1).logits[:-1])  # [n, Vd]: q_i for position i
        y = torch.multinomial(q, 1, generator=generator).squeeze(-1)  # [n] Y_i ~ q_i
        if sampling.greedy and greedy_answers:  # p_i is one-hot at X_i = argmax p_i: no target forward needed
            label = (y == x).float()
        else:
            target.reset()
            p = sampling.probs(target.forward(seq, last=n + 1).logits[:-1]).to(draft.device)  # [n, V]: p_i judges X_i
            vocab = max(p.shape[-1], q.shape[-1])  # a padded vocabulary on either side: zeros there
            label = acceptance_labels(fit_vocab(p, vocab), fit_vocab(q, vocab), y)  # [n]
        z, from_draft = mix_tokens(x, y, r, generator)
        draft.reset()
        e = draft.forward(prompt + z.tolist(), last=n, hidden=True).hidden  # [n, H]: e_i reads Z_i
        features.append(e[from_draft].float().cpu())
        labels.append(label[from_draft].float().cpu())
        response.append(torch.full((int(from_draft.sum()),), index))
    target.reset()
    draft.reset()
    require(features, "no training positions: the target's answers are empty (check the prompts and --max-new-tokens)")
    return Examples(torch.cat(features), torch.cat(labels), torch.cat(response))


def label_head_chains(
    target: Runner,
    head: FeatureHead,
    prompts: list[list[int]],
    answers: list[list[int]],
    sampling: Sampling,
    depth: int,
    vocab: int,
    progress: bool = True,
) -> Examples:
    """Steps 2-3 for a feature head (SpecDec++ over the head: `drafters.feature` with a policy).

    On the target's answer, the head drafts a chain from every root whose first draft is an answer token, as it
    drafts while decoding: its most likely token among its `vocab` most frequent, `depth` drafts at most, each
    read from the head's predicted feature (`feature_losses.rollout`: the head's inputs before the root are the
    target's own features). That predicted feature is the training input of the draft it produced (what
    `AcceptanceHeadPolicy.judge` reads), and its label the chance that the target accepts the draft: 1 or 0
    for greedy answers (is it the answer's token?), p(draft) under the answers' sampling settings else (a
    deterministic guess is accepted with its probability). A chain's drafts count up to its first one off the
    answer: the policy judges a draft only while the earlier ones were accepted.
    """
    from tqdm import tqdm

    from draftverify.tools.make_draft.feature_losses import rollout

    features, labels, response = [], [], []
    n_vocab = vocab or head.vocab.numel()
    for index, (prompt, answer) in enumerate(
        tqdm(list(zip(prompts, answers)), desc="labelling", unit="answer", disable=not progress)
    ):
        seq = prompt + answer
        n = len(seq) - 2  # head inputs at positions 0..n-1: (f_t, token t + 1) -> the draft of token t + 2
        if not answer or n < 1:
            continue
        target.reset()
        out = target.forward(seq, last=len(seq), hidden=True)  # f_t after every token t
        ids = torch.tensor(seq, device=out.hidden.device)
        truth = ids[2:]  # [n]: the answer's token at each input's drafted position
        with torch.no_grad():
            steps = rollout(head, out.hidden[None, :n].to(head.fc.weight.dtype), ids[None, 1 : n + 1], depth)
        # [n, V]: the target's law of each drafted token, for labels under sampling settings
        law = None if sampling.greedy else sampling.probs(out.logits[1 : n + 1].float())
        for produced, label in _chain_drafts(head, steps, truth, len(prompt), law, n_vocab):
            features.append(produced.float().cpu())
            labels.append(label.float().cpu())
            response.append(torch.full((len(label),), index))
    target.reset()
    require(features, "no training positions: the target's answers are empty (check the prompts and --max-new-tokens)")
    return Examples(torch.cat(features), torch.cat(labels), torch.cat(response))


def _chain_drafts(head: FeatureHead, steps: list, truth: torch.Tensor, prompt: int, p: torch.Tensor | None, vocab: int):
    """Per depth d, for the chains still on the answer: the predicted features that produced their draft d and its
    labels (`label_head_chains`; `steps`: the rollout's, `truth` [n]: the answer's token at each input's drafted
    position, `p` [n, V]: the target's law there when sampling, None for greedy labels)."""
    n = truth.shape[0]
    roots = torch.arange(n, device=truth.device)
    alive = roots + 2 >= prompt  # [n]: chains whose drafts are all still on the answer
    for d, step in enumerate(steps, start=1):  # draft d of the chain rooted at r reads position r + d - 1
        at = roots + d - 1
        alive = alive & (at < n)
        if not alive.any():
            return
        at = at.clamp(max=n - 1)
        produced = step[0, at]  # [n, H]: the predicted feature that produced each chain's draft d
        with torch.no_grad():
            draft = head.vocab[head.logits(produced, vocab).argmax(-1)]  # [n]
        right = draft == truth[at]
        label = right.float() if p is None else p[at].gather(-1, draft[:, None]).squeeze(-1)
        yield produced[alive], label[alive]
        alive = alive & right


def labelled_examples(
    target: Loaded,
    draft: Loaded | FeatureHead,
    ids: list[list[int]],
    answers: list[list[int]],
    sampling: Sampling,
    r: float,
    seed: int,
    cache_dir: Path | None = None,
    progress: bool = True,
    depth: int = CHAIN_DEPTH,
    vocab: int = DRAFT_VOCAB,
    runner: Runner | None = None,
) -> Examples:
    """Steps 2-3 for the answers of step 1, cached under a key of the pair, the answers, the sampling, r and seed
    (a feature head as the draft: `label_head_chains`, with `depth` and `vocab` in the key instead of r and seed;
    on `runner` when given, e.g. an engine's in the target's arithmetic, else on a new fp32 runner)."""
    if isinstance(draft, FeatureHead):
        key = _key("chains", target.identity, draft.identity, ids, answers, _describe(sampling), depth, vocab)
        runner = runner or Runner(target.model)
        return _cached_examples(
            cache_dir, key, lambda: label_head_chains(runner, draft, ids, answers, sampling, depth, vocab, progress)
        )
    key = _key("examples", target.identity, draft.identity, ids, answers, _describe(sampling), r, seed)
    return _cached_examples(
        cache_dir,
        key,
        lambda: label_responses(
            Runner(target.model),
            Runner(draft.model),
            ids,
            answers,
            sampling,
            r,
            seed,
            progress,
            greedy_answers=sampling.greedy,
        ),
    )


# -- caching -------------------------------------------------------------------------------


def _cached_examples(cache_dir: Path | None, key: str, make) -> Examples:
    """The examples cached under `key`, else `make()`'s, cached for the next run."""
    examples = _read_examples(cache_dir, f"examples-{key}.safetensors")
    if examples is None:
        examples = make()
        _write_examples(cache_dir, f"examples-{key}.safetensors", examples)
    return examples


def _describe(sampling: Sampling) -> list:
    """What the data depend on: the seed matters only when sampling."""
    return [sampling.temperature, sampling.top_k, sampling.top_p, None if sampling.greedy else sampling.seed]


def _key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _read_json(cache_dir: Path | None, name: str):
    if cache_dir is None or not (cache_dir / name).is_file():
        return None
    try:
        return json.loads((cache_dir / name).read_text())
    except json.JSONDecodeError:
        return None  # a damaged cache entry is recomputed


def _write_json(cache_dir: Path | None, name: str, value) -> None:
    if cache_dir is None:
        return
    atomic_write(cache_dir / name, json.dumps(value))


def _read_examples(cache_dir: Path | None, name: str) -> Examples | None:
    from safetensors.torch import load_file

    if cache_dir is None or not (cache_dir / name).is_file():
        return None
    try:
        t = load_file(cache_dir / name)
        return Examples(t["features"].float(), t["labels"], t["response"])
    except Exception:
        return None  # a damaged cache entry is recomputed


def _write_examples(cache_dir: Path | None, name: str, examples: Examples) -> None:
    from safetensors.torch import save_file

    if cache_dir is None:
        return
    with atomic_path(cache_dir / name) as tmp:
        save_file({"features": examples.features.half(), "labels": examples.labels, "response": examples.response}, tmp)
