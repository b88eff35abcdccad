"""The feature head's training loss with EAGLE-3's training-time test, its batches and its held-out agreement.

At position t the head reads the target's feature f_t and token t + 1 and predicts f_{t+1}; the loss is the
cross-entropy between the head's distribution over its vocabulary and the target's own (its LM head on the true
f_{t+1}, restricted to the same vocabulary), plus a small smooth-L1 term on the feature. Rollout step s >= 2 feeds
the head's step s - 1 prediction for position t as its input at t, attending the true inputs before the draft began
and the rolled-out inputs since, exactly as a draft of depth s does.
"""

from __future__ import annotations

import random
from collections import Counter

import torch
import torch.nn.functional as F

from draftverify.feature_head import FeatureHead
from draftverify.tools.make_draft.feature_settings import HeadTraining
from draftverify.tools.make_draft.features import Sequence


def frequent_vocab(sequences: list[Sequence], n: int, always: tuple[int, ...]) -> list[int]:
    """The n most frequent reply tokens (FR-Spec), the `always` tokens (EOS) included."""
    counts = Counter()
    for s in sequences:
        counts.update(s.ids[s.start :].tolist())
    vocab = list(always)
    vocab += [t for t, _ in counts.most_common() if t not in always][: max(0, n - len(vocab))]
    return vocab


def padded(batch: list[Sequence], max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T], features [B, T - 1, H] (fp32), lengths [B], reply starts [B]; cut to max_len tokens."""
    t = min(max_len, max(len(s.ids) for s in batch))
    h = batch[0].features.shape[-1]
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    feats = torch.zeros(len(batch), t - 1, h)
    lengths, starts = [], []
    for b, s in enumerate(batch):
        n = min(t, len(s.ids))
        ids[b, :n] = s.ids[:n].long()
        feats[b, : n - 1] = s.features[: n - 1].float()
        lengths.append(n)
        starts.append(s.start)
    return ids, feats, torch.tensor(lengths), torch.tensor(starts)


def rollout_mask(t: int, step: int) -> torch.Tensor:
    """bool [T, step * T]: rollout step `step` at position i attends the true inputs j <= i - step + 1
    and the step-r inputs at j = i - step + r (r = 2..step): a draft of depth `step`."""
    i = torch.arange(t).unsqueeze(1)
    j = torch.arange(t).unsqueeze(0)
    blocks = [j <= i - step + 1] + [j == i - step + r for r in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def rollout(head: FeatureHead, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's predicted features [B, n, H] at rollout steps 1..steps: step s at position t is what a
    draft of depth s predicts there (inputs (f_t, token t + 1) at positions 0..n-1; see the module docstring)."""
    b, n, _ = features.shape
    positions = torch.arange(n).expand(b, n)
    keys, values, outs, inputs = [], [], [], features
    for step in range(1, steps + 1):
        x = head.inputs(inputs, tokens)
        q, k, v = head.qkv(x, positions)
        keys.append(k)
        values.append(v)
        outs.append(head.finish(x, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), rollout_mask(n, step)))
        inputs = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)  # the prediction for position t feeds t + 1
    return outs


def head_losses(head: FeatureHead, ids, feats, lengths, starts, rollout_steps: int, feature_weight: float):
    """Loss (weighted over rollout steps) and, per step, (correct top-1 on reply tokens, reply tokens)."""
    b, t = ids.shape
    n = t - 2  # inputs at positions 0..T-3: (f_t, token t+1) -> f_{t+1}
    f_in, tok, f_out = feats[:, :n], ids[:, 1 : n + 1], feats[:, 1 : n + 1]
    positions = torch.arange(n).expand(b, n)
    valid = positions < (lengths - 2).unsqueeze(1)  # [B, n]
    reply = valid & (positions + 2 >= starts.unsqueeze(1))  # predicts a reply token
    with torch.no_grad():
        target = F.softmax(head.logits(f_out), dim=-1)  # [B, n, N] the target's distribution on the vocab
    truth = ids[:, 2 : n + 2]
    total, stats = 0.0, []
    for step, out in enumerate(rollout(head, f_in, tok, rollout_steps), start=1):
        logits = head.logits(out)
        ok = valid & (positions >= step - 1)
        ce = -(target * F.log_softmax(logits, dim=-1)).sum(-1)
        fl = F.smooth_l1_loss(out, f_out, reduction="none").mean(-1)
        total = total + ((ce + feature_weight * fl) * ok).sum() / ok.sum().clamp_min(1) * (0.8 ** (step - 1))
        mine = reply & ok
        stats.append((int(((head.vocab[logits.argmax(-1)] == truth) & mine).sum()), int(mine.sum())))
    return total, stats


def batches(sequences: list[Sequence], config: HeadTraining, epoch: int, batch_tokens: int = 0) -> list[list[int]]:
    """Indices of each batch for `epoch`: similar lengths together, at most `batch_tokens` padded tokens a batch
    (0: `config.batch_tokens`; feature_schedule.epoch_batch_tokens), batch order shuffled by (seed, epoch)."""
    batch_tokens = batch_tokens or config.batch_tokens
    rng = random.Random(config.seed * 1_000_003 + epoch)
    order = sorted(range(len(sequences)), key=lambda i: (min(len(sequences[i].ids), config.max_len), rng.random()))
    out, cur, width = [], [], 0
    for i in order:
        n = min(len(sequences[i].ids), config.max_len)
        if cur and (len(cur) + 1) * max(width, n) > batch_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def acceptance(head: FeatureHead, heldout: list[Sequence], config: HeadTraining) -> list[float]:
    """Top-1 agreement with the target's greedy reply at draft depths 1..rollout (teacher-forced prefix)."""
    hits = [[0, 0] for _ in range(config.rollout)]
    with torch.no_grad():
        for i in range(0, len(heldout), 8):
            ids, feats, lengths, starts = padded(heldout[i : i + 8], config.max_len)
            _, stats = head_losses(head, ids, feats, lengths, starts, config.rollout, config.feature_weight)
            for h, (a, n) in zip(hits, stats):
                h[0] += a
                h[1] += n
    return [a / max(n, 1) for a, n in hits]
