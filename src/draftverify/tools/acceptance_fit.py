"""Fitting the SpecDec++ acceptance head (Huang et al. 2024, section 3.3, step 4) and its training report.

f_theta is fitted by weighted binary cross-entropy (w_acc on the accept side, w_rej on the reject side) and
judged on held-out responses: loss and calibration (reliability bins, ECE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.drafters.acceptance_head import AcceptanceHead
from draftverify.errors import require
from draftverify.tools.acceptance_data import Examples


@dataclass(frozen=True)
class TrainSettings:
    depth: int = 1  # D: residual blocks before the output layer (0 = linear head)
    r: float = 0.15  # fraction of response positions that keep the target's token
    w_acc: float = 1.0
    w_rej: float = 6.0
    epochs: int = 7  # the shipped head's setting (docs/specdec.md); more can over-fit: see the held-out loss
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


def report_markdown(head: AcceptanceHead, path: Path) -> str:
    """A short human-readable training report for a head."""
    s, report = head.settings, head.settings["report"]
    t = s["training"]
    lines = [
        f"# Acceptance head `{path.name}`",
        "",
        f"D={t['depth']}, r={t['r']}, w_acc={t['w_acc']}, w_rej={t['w_rej']}, epochs={t['epochs']}, lr={t['lr']}, "
        f"seed={t['seed']}; "
        f"sampling {s['sampling']}; {s['prompts']} prompts, {s['answer_tokens']} answer tokens (max "
        f"{s['max_new_tokens']} per answer).",
        f"Training positions: {report['train_positions']} from {report['train_responses']} responses "
        f"(mean label {report['train_mean_label']:.3f}); held out: {report['heldout_responses']} responses.",
        "",
        "| epoch | train weighted BCE | held-out weighted BCE |",
        "|---|---|---|",
    ]
    for row in report["history"]:
        lines.append(
            f"| {row['epoch']} | {row['train_weighted_bce']:.4f} | "
            f"{row.get('heldout_weighted_bce', float('nan')):.4f} |"
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
                f"| {b['bin'][0]:.1f}-{b['bin'][1]:.1f} | {b['count']} | {b['mean_predicted']:.3f} | "
                f"{b['mean_label']:.3f} |"
            )
    return "\n".join(lines) + "\n"
