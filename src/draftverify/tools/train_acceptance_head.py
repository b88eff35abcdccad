"""Training data and training for the SpecDec++ acceptance head (`draftverify train-acceptance-head`).

Huang et al. 2024, section 3.3. Steps:
1. the target answers the training prompts: X_1..X_N (batched `generate`, cached on disk);
2. on the target's prefix X_<i, the target gives p_i and the draft q_i; Y_i ~ q_i and its label is
   the chance it would be accepted, P_i = min(1, p_i(Y_i) / q_i(Y_i)) (with greedy settings p and
   q are one-hot, so P_i = 1 exactly when the draft's argmax is the target's);
3. the draft reads a mixed response Z: Z_i = X_i for a fraction r of positions, Y_i for the rest
   (the paper's BERT-style mixing, so the draft sees its own tokens as at inference); its final
   hidden state e_i at each position reading a Y_i is one training input, with label P_i;
4. f_theta is fitted by weighted binary cross-entropy (w_acc on the accept side, w_rej on the
   reject side) and judged on held-out responses: loss and calibration (reliability bins, ECE).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import typer

from draftverify.drafters.acceptance_head import AcceptanceHead, save_head
from draftverify.errors import require
from draftverify.models import Loaded, Runner
from draftverify.sampling import Sampling
from draftverify.util import atomic_path, atomic_write, cache_root
from draftverify.verify import fit_vocab

SHIPPED_PROMPTS = Path(__file__).parent.parent / "assets" / "specdec-prompts.jsonl"


@dataclass(frozen=True)
class TrainSettings:
    depth: int = 1  # D: residual blocks before the output layer (0 = linear head)
    r: float = 0.15  # fraction of response positions that keep the target's token
    w_acc: float = 1.0
    w_rej: float = 6.0
    epochs: int = 7  # held-out loss of the default pair was lowest at 7 (it rose after: over-fitting)
    lr: float = 1e-3
    batch_size: int = 256
    holdout: float = 0.1  # fraction of responses held out for the loss / calibration report
    seed: int = 0

    def __post_init__(self):
        require(
            0 <= self.r < 1, f"mixing fraction r={self.r} must lie in [0, 1): some positions must hold draft tokens"
        )
        require(
            self.w_acc > 0 and self.w_rej > 0, f"loss weights w_acc={self.w_acc}, w_rej={self.w_rej} must be positive"
        )
        require(self.epochs >= 1, f"epochs={self.epochs} must be at least 1")
        require(self.lr > 0 and self.batch_size >= 1, "learning rate and batch size must be positive")
        require(0 <= self.holdout < 1, f"holdout={self.holdout} must lie in [0, 1)")


@dataclass
class Examples:
    """Training inputs: hidden states e [N, H], labels P [N] and the response each came from [N]."""

    features: torch.Tensor
    labels: torch.Tensor
    response: torch.Tensor


# -- prompts and the target's answers -------------------------------------------------------


def read_prompts(path: str | Path, chat: bool = True) -> list[tuple[str, bool]]:
    """Prompts from a .jsonl file ({"prompt": ..., optional "chat": bool}) or a text file (one per line)."""
    path = Path(path)
    require(
        path.is_file(), f"prompt file {path} does not exist: pass --prompts FILE (.jsonl with a prompt field, or .txt)"
    )
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            require(
                isinstance(row, dict) and isinstance(row.get("prompt"), str),
                f"{path}:{number} is not a JSON object with a prompt field",
            )
            prompts.append((row["prompt"], bool(row.get("chat", chat))))
        else:
            prompts.append((line.replace("\\n", "\n"), chat))
    require(prompts, f"prompt file {path} holds no prompts")
    return prompts


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

    Batched `generate` with left padding: on CPU a batch costs little more per step than one
    sequence. The answers are training data only, so padding's tiny numerical effects do not
    matter. Finished batches are saved as they come, so an interrupted run resumes.
    """
    key = _key("answers", target.identity, prompts, max_new_tokens, _describe(sampling), eos_ids)
    cached = _read_json(cache_dir, f"answers-{key}.json")
    if cached is not None:
        return cached
    from tqdm import tqdm

    model = target.model
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    device = target.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    partial = _read_json(cache_dir, f"answers-{key}.partial.json") or {"batch_size": batch_size, "done": {}}
    done = {int(i): a for i, a in partial["done"].items()} if partial["batch_size"] == batch_size else {}
    sample_kwargs = {"do_sample": False}
    if not sampling.greedy:
        sample_kwargs = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k or None,
            "top_p": sampling.top_p,
        }
    todo = [rows for rows in batches if not all(i in done for i in rows)]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(
            (sampling.seed or 0) + len(batches) - len(todo)
        )  # `generate` samples from the global generator
        for rows in tqdm(
            todo,
            desc="target answers",
            unit="batch",
            disable=not progress,
            initial=len(batches) - len(todo),
            total=len(batches),
        ):
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows], device=device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=list(eos_ids) or None,
                **sample_kwargs,
            )
            for row, i in enumerate(rows):
                done[i] = _cut_after_eos(out[row, width:].tolist(), eos_ids)
            _write_json(cache_dir, f"answers-{key}.partial.json", {"batch_size": batch_size, "done": done})
    answers = [done[i] for i in range(len(prompts))]
    _write_json(cache_dir, f"answers-{key}.json", answers)
    if cache_dir is not None:
        (cache_dir / f"answers-{key}.partial.json").unlink(missing_ok=True)
    return answers


def _cut_after_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    for n, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: n + 1]
    return tokens


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


# -- training ------------------------------------------------------------------------------


def weighted_bce(
    logits: torch.Tensor,  # [N] head outputs f_theta(e_i)
    labels: torch.Tensor,  # [N] P_i in [0, 1]
    w_acc: float,
    w_rej: float,
) -> torch.Tensor:
    """-sum(w_acc P log p_hat + w_rej (1 - P) log(1 - p_hat)) / sum(w_acc P + w_rej (1 - P))."""
    weight_acc, weight_rej = w_acc * labels, w_rej * (1 - labels)
    loss = weight_acc * torch.nn.functional.softplus(-logits) + weight_rej * torch.nn.functional.softplus(logits)
    return loss.sum() / (weight_acc + weight_rej).sum()


def calibration(p_hat: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> tuple[float, list[dict]]:
    """Expected calibration error and reliability bins (equal-width in p_hat)."""
    index = (p_hat * bins).long().clamp(max=bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        mask = index == b
        count = int(mask.sum())
        if count == 0:
            continue
        pred, true = p_hat[mask].mean().item(), labels[mask].mean().item()
        ece += count / len(p_hat) * abs(pred - true)
        table.append({"bin": [b / bins, (b + 1) / bins], "count": count, "mean_predicted": pred, "mean_label": true})
    return ece, table


def evaluate(head: AcceptanceHead, examples: Examples, w_acc: float, w_rej: float, base_rate: float) -> dict:
    """Held-out figures: weighted and plain BCE, the plain BCE of always predicting the training
    base rate (the head must beat it to be informative), and calibration."""
    with torch.no_grad():
        logits = head(examples.features)
    y = examples.labels
    constant = torch.full_like(y, math.log(base_rate / (1 - base_rate)))
    ece, bins = calibration(torch.sigmoid(logits), y)
    return {
        "positions": len(y),
        "mean_label": y.mean().item(),
        "weighted_bce": weighted_bce(logits, y, w_acc, w_rej).item(),
        "bce": weighted_bce(logits, y, 1.0, 1.0).item(),
        "bce_constant": weighted_bce(constant, y, 1.0, 1.0).item(),
        "ece": ece,
        "reliability": bins,
    }


def fit_head(examples: Examples, settings: TrainSettings, progress: bool = True) -> tuple[AcceptanceHead, dict]:
    """Train f_theta on the examples; return it and a report (per-epoch losses, held-out figures)."""
    from tqdm import trange

    generator = torch.Generator().manual_seed(settings.seed)
    responses = examples.response.unique()
    n_held = round(settings.holdout * len(responses)) if len(responses) > 1 else 0
    held = responses[torch.randperm(len(responses), generator=generator)[:n_held]]
    is_held = torch.isin(examples.response, held)
    train = Examples(examples.features[~is_held], examples.labels[~is_held], examples.response[~is_held])
    test = Examples(examples.features[is_held], examples.labels[is_held], examples.response[is_held])
    require(
        len(train.labels) > 0, "no training positions left after the held-out split: lower --holdout or add prompts"
    )
    base_rate = min(max(train.labels.mean().item(), 1e-4), 1 - 1e-4)

    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)  # the head's initial weights
        head = AcceptanceHead(train.features.shape[1], settings.depth)
    with torch.no_grad():  # start from the base rate: the first epochs then learn the signal, not the bias
        head.out.bias.fill_(math.log(base_rate / (1 - base_rate)))
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    history = []
    for epoch in trange(settings.epochs, desc="training head", unit="epoch", disable=not progress):
        head.train()
        order = torch.randperm(len(train.labels), generator=generator)
        total = 0.0
        for start in range(0, len(order), settings.batch_size):
            batch = order[start : start + settings.batch_size]
            loss = weighted_bce(head(train.features[batch]), train.labels[batch], settings.w_acc, settings.w_rej)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        head.eval()
        row = {"epoch": epoch + 1, "train_weighted_bce": total / len(order)}
        if len(test.labels):
            row["heldout_weighted_bce"] = evaluate(head, test, settings.w_acc, settings.w_rej, base_rate)[
                "weighted_bce"
            ]
        history.append(row)
    report = {
        "train_positions": len(train.labels),
        "train_responses": len(responses) - n_held,
        "heldout_responses": n_held,
        "train_mean_label": train.labels.mean().item(),
        "history": history,
        "heldout": evaluate(head, test, settings.w_acc, settings.w_rej, base_rate) if len(test.labels) else None,
    }
    return head.eval().requires_grad_(False), report


# -- the whole pipeline ---------------------------------------------------------------------


def train_acceptance_head(
    target: Loaded,
    draft: Loaded,
    prompts: list[tuple[str, bool]],
    settings: TrainSettings,
    sampling: Sampling = Sampling(),
    max_new_tokens: int = 96,
    answer_batch: int = 48,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> AcceptanceHead:
    """Steps 1-4; returns the head with `settings` (training settings and report) filled in."""
    ids, answers = target_answers(target, prompts, sampling, max_new_tokens, answer_batch, cache_dir, progress)
    key = _key(
        "examples", target.identity, draft.identity, ids, answers, _describe(sampling), settings.r, settings.seed
    )
    examples = _read_examples(cache_dir, f"examples-{key}.safetensors")
    if examples is None:
        examples = label_responses(
            Runner(target.model),
            Runner(draft.model),
            ids,
            answers,
            sampling,
            settings.r,
            settings.seed,
            progress,
            greedy_answers=sampling.greedy,
        )
        _write_examples(cache_dir, f"examples-{key}.safetensors", examples)
    head, report = fit_head(examples, settings, progress=progress)
    head.settings = {
        "training": dict(vars(settings)),
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "answer_tokens": sum(len(a) for a in answers),
        "report": report,
    }
    return head


def report_markdown(head: AcceptanceHead, path: Path) -> str:
    """A short human-readable training report for a head."""
    s, report = head.settings, head.settings["report"]
    t = s["training"]
    lines = [
        f"# Acceptance head `{path.name}`",
        "",
        f"D={t['depth']}, r={t['r']}, w_acc={t['w_acc']}, w_rej={t['w_rej']}, epochs={t['epochs']}, lr={t['lr']}, seed={t['seed']}; "
        f"sampling {s['sampling']}; {s['prompts']} prompts, {s['answer_tokens']} answer tokens (max {s['max_new_tokens']} per answer).",
        f"Training positions: {report['train_positions']} from {report['train_responses']} responses "
        f"(mean label {report['train_mean_label']:.3f}); held out: {report['heldout_responses']} responses.",
        "",
        "| epoch | train weighted BCE | held-out weighted BCE |",
        "|---|---|---|",
    ]
    for row in report["history"]:
        lines.append(
            f"| {row['epoch']} | {row['train_weighted_bce']:.4f} | {row.get('heldout_weighted_bce', float('nan')):.4f} |"
        )
    held = report["heldout"]
    if held:
        lines += [
            "",
            f"Held-out ({held['positions']} positions, mean label {held['mean_label']:.3f}): BCE {held['bce']:.4f} "
            f"(constant base-rate predictor: {held['bce_constant']:.4f}), weighted BCE {held['weighted_bce']:.4f}, "
            f"ECE {held['ece']:.4f}.",
            "",
            "| p_hat bin | positions | mean p_hat | mean label |",
            "|---|---|---|---|",
        ]
        for b in held["reliability"]:
            lines.append(
                f"| {b['bin'][0]:.1f}-{b['bin'][1]:.1f} | {b['count']} | {b['mean_predicted']:.3f} | {b['mean_label']:.3f} |"
            )
    return "\n".join(lines) + "\n"


# -- caching -------------------------------------------------------------------------------


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


# -- the command ---------------------------------------------------------------------------


def train_acceptance_head_command(
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Where to write the head (.safetensors); a training report (.md) is written next to it.",
    ),
    target: Optional[str] = typer.Option(
        None, "--target", "-t", help="Target model: a local HF folder or a .gguf file. Default: SmolLM2-135M-Instruct."
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        help="Draft model the head is for: a HF folder, a .gguf file or self:layers=N. Default: the target's default draft.",
    ),
    prompts: Path = typer.Option(
        SHIPPED_PROMPTS,
        "--prompts",
        "-p",
        help="Training prompts: .jsonl with a prompt field (and optional chat: bool) or .txt, one per line. Keep them disjoint from your benchmark prompts.",
    ),
    chat: bool = typer.Option(True, help="Wrap prompts in the chat template unless their JSONL row says otherwise."),
    depth: int = typer.Option(
        1, "--depth", "-D", help="D: residual SiLU blocks before the output layer (0 = a linear head)."
    ),
    r: float = typer.Option(
        0.15,
        "--mix",
        "-r",
        help="r: fraction of response positions that keep the target's token; the rest hold draft samples and carry the loss.",
    ),
    w_acc: float = typer.Option(1.0, help="Loss weight of the accept side of the binary cross-entropy."),
    w_rej: float = typer.Option(
        6.0, help="Loss weight of the reject side (the paper tries 1, 3, 6, 12; larger stops drafting earlier)."
    ),
    epochs: int = typer.Option(
        7,
        help="Passes over the training positions (the default pair over-fitted after 7: watch the held-out column of the report).",
    ),
    lr: float = typer.Option(1e-3, help="AdamW learning rate."),
    batch_size: int = typer.Option(256, help="Training positions per optimiser step."),
    holdout: float = typer.Option(0.1, help="Fraction of responses held out for the loss and calibration report."),
    seed: int = typer.Option(0, help="Seed for draft samples, mixing, the split and the initial weights."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", "-n", help="Length cap of the target's answers."),
    temperature: float = typer.Option(
        0.0,
        help="Sampling settings the head is for: 0 = greedy labels (argmax match); > 0 labels min(1, p/q) at this temperature.",
    ),
    top_k: int = typer.Option(0, help="Top-k of the sampling settings the head is for (0 = off)."),
    top_p: float = typer.Option(1.0, help="Top-p of the sampling settings the head is for (1 = off)."),
    answer_batch: int = typer.Option(
        48, help="Prompts per batched `generate` call while the target answers (larger is faster per token on CPU)."
    ),
    cache: bool = typer.Option(
        True, help="Cache the target's answers and the labelled positions under ~/.cache/draftverify/specdec."
    ),
    dtype: str = typer.Option("auto", help="Weights dtype: auto, fp32, bf16 or fp16."),
    device: str = typer.Option("auto", help="Device: auto, cpu, cuda or cuda:N."),
):
    """Train a SpecDec++ acceptance head for a draft/target pair (use it with `-m specdec-pp -o head=PATH`)."""
    from draftverify.models import load_draft, load_model

    require(out.suffix == ".safetensors", f"--out {out} must end in .safetensors")
    settings = TrainSettings(depth, r, w_acc, w_rej, epochs, lr, batch_size, holdout, seed)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    rows = read_prompts(prompts, chat)
    target_model = load_model(target, dtype=dtype, device=device)
    draft_model = load_draft(draft, target_model, dtype=dtype, device=device)
    require(
        draft_model is not None,
        "train-acceptance-head needs a draft model: pass --draft (a folder, a .gguf file or self:layers=N)",
    )
    cache_dir = cache_root() / "specdec" if cache else None
    head = train_acceptance_head(target_model, draft_model, rows, settings, sampling, max_new_tokens, answer_batch, cache_dir)
    save_head(out, head, draft_model.identity, target_model.identity)
    report = report_markdown(head, out)
    out.with_suffix(".md").write_text(report)
    typer.echo(report)
    typer.echo(f"wrote {out} ({out.stat().st_size // 1024} KB) and {out.with_suffix('.md')}")
