"""The draft model: initialised from a few of the target's layers, trained to match the target.

- `init_draft`: the target's architecture with `len(layer_ids)` decoder layers, copied from the
  target's layers `layer_ids`, plus its embeddings, final norm and head. The embeddings and the
  head stay frozen (and are the target's own tensors when dtype and device allow), so training
  only moves the copied layers and the norm.
- `choose_layers`: which layers to copy, picked by measurement: the candidate layer sets are
  scored by their held-out KL before any training and the lowest wins.
- `distill_loss`: KL(p || q) per target position, p = the target's next-token distribution
  renormalised over its top-k tokens, q = the draft's full softmax, plus the greedy agreement
  (draft argmax == target argmax), the per-token acceptance rate of greedy speculative decoding.
- `train`: the distillation loop (AdamW, warm-up then cosine decay, bf16 matmuls on a CPU that has them), with
  checkpoints a resumed build continues from.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.errors import require
from draftverify.loading import Loaded, layer_prefix
from draftverify.tools.make_draft.data import TrainingRecord
from draftverify.util import atomic_path


def candidate_layer_sets(total: int, n: int) -> dict[str, tuple[int, ...]]:
    """Named ways to keep `n` of `total` layers: the first n, evenly spread, first and last halves."""
    require(1 <= n < total, f"--layers {n} is impossible: the target has {total} layers, use 1..{total - 1}")
    spread = tuple(round(i * (total - 1) / (n - 1)) for i in range(n)) if n > 1 else (0,)
    sets = {
        "first": tuple(range(n)),
        "spread": spread,
        "first+last": tuple(range(n - 1)) + (total - 1,),
        "ends": tuple(range((n + 1) // 2)) + tuple(range(total - n // 2, total)),
    }
    unique = {}
    for name, ids in sets.items():
        if ids not in unique.values():
            unique[name] = ids
    return unique


def init_draft(target: Loaded, layer_ids: tuple[int, ...]) -> torch.nn.Module:
    """A fp32 model of the target's class with the target's layers `layer_ids` (copied) and embeddings (frozen)."""
    total = target.model.config.num_hidden_layers
    require(all(0 <= i < total for i in layer_ids), f"layer ids {layer_ids} must lie in 0..{total - 1}")
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = len(layer_ids)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in layer_ids]
    config.dtype = torch.float32
    with torch.device("meta"):
        model = type(target.model)(config)
    prefix = layer_prefix(target.model)
    source = {name: tensor for name, tensor in target.model.state_dict().items()}
    state = {}
    for name, tensor in source.items():
        if name.startswith(prefix):
            index, _, rest = name[len(prefix) :].partition(".")
            if int(index) not in layer_ids:
                continue
            name = f"{prefix}{layer_ids.index(int(index))}.{rest}"
        state[name] = tensor.detach().to("cpu", torch.float32, copy=True)
    model.load_state_dict(state, strict=False, assign=True)
    for name, buf in list(
        model.named_buffers()
    ):  # non-persistent buffers (rotary frequencies) are not in the state dict
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = dict(target.model.named_buffers())[name].detach().to("cpu", copy=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    require(not missing, f"the draft left parameters uninitialised ({missing[:3]}): this architecture is unsupported")
    model.to(target.device)
    model.generation_config = copy.deepcopy(target.model.generation_config)
    model.requires_grad_(True)
    for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
        emb.weight.requires_grad_(False)
    model.train()
    _check_head(model)
    return model


def _check_head(model: torch.nn.Module) -> None:
    """The loss computes logits as head(last hidden state) on target positions only: make sure that is the model's own
    rule."""
    ids = torch.arange(8, device=model.device).view(1, 8) % model.config.vocab_size
    with torch.no_grad():
        full = model(input_ids=ids).logits
        mine = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state)
    require(
        torch.allclose(full, mine, atol=1e-4, rtol=1e-4),
        f"{type(model).__name__} does not compute logits as head(last hidden state): make-draft does not support it",
    )


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class TrainingBatch:
    ids: torch.Tensor  # [B, T] long, right-padded
    mask: torch.Tensor  # [B, T] 1 = real token
    rows: torch.Tensor  # [M] batch row of each target position
    cols: torch.Tensor  # [M] position of each target position
    logp: torch.Tensor  # [M, k] target top-k log-probs
    idx: torch.Tensor  # [M, k] target top-k token ids


def collate(records: list[TrainingRecord], max_len: int, device) -> TrainingBatch:
    width = min(max_len, max(len(r.ids) for r in records))
    ids = torch.zeros(len(records), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, logp, idx = [], [], [], []
    for b, r in enumerate(records):
        t = min(width, len(r.ids))
        ids[b, :t] = r.ids[:t].long()
        mask[b, :t] = 1
        n = max(0, min(r.logp.shape[0], t - r.start))  # target rows whose position lies within the kept tokens
        rows.append(torch.full((n,), b, dtype=torch.long))
        cols.append(torch.arange(r.start, r.start + n))
        logp.append(r.logp[:n])
        idx.append(r.idx[:n])
    return TrainingBatch(
        ids.to(device),
        mask.to(device),
        torch.cat(rows).to(device),
        torch.cat(cols).to(device),
        torch.cat(logp).to(device),
        torch.cat(idx).to(device).long(),
    )


def batches(records: list[TrainingRecord], token_budget: int, max_len: int, seed: int, epoch: int) -> list[list[int]]:
    """Record indices grouped into batches of at most `token_budget` tokens, in an order fixed by (seed, epoch)."""
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    groups, current, used = [], [], 0
    for i in order:
        size = min(len(records[i].ids), max_len)
        if current and used + size > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        groups.append(current)
    return groups


def distill_loss(model: torch.nn.Module, batch: TrainingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean KL(p || q) over target positions, agreements [M] bool)."""
    h = model.base_model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state  # [B, T, H]
    logits = model.get_output_embeddings()(h[batch.rows, batch.cols]).float()  # [M, V]
    logq = torch.log_softmax(logits, dim=-1).gather(-1, batch.idx)  # [M, k]
    logp = torch.log_softmax(batch.logp.float(), dim=-1)  # [M, k]: p renormalised over the top-k
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [M]
    return kl.mean(), logits.argmax(-1) == batch.idx[:, 0]


@torch.no_grad()
def evaluate(model: torch.nn.Module, records: list[TrainingRecord], token_budget: int, max_len: int) -> dict:
    """Held-out mean KL and greedy agreement (fraction of positions where draft and target argmax agree)."""
    was_training = model.training
    model.eval()
    total_kl, agree, n = 0.0, 0, 0
    for group in batches(records, token_budget, max_len, seed=0, epoch=0):
        batch = collate([records[i] for i in group], max_len, model.device)
        kl, agreed = distill_loss(model, batch)
        total_kl += kl.item() * agreed.numel()
        agree += int(agreed.sum())
        n += agreed.numel()
    model.train(was_training)
    return {"kl": total_kl / max(n, 1), "agreement": agree / max(n, 1), "positions": n}


def choose_layers(
    target: Loaded, n: int, heldout: list[TrainingRecord], token_budget: int, max_len: int
) -> tuple[tuple[int, ...], dict]:
    """The candidate layer set with the lowest held-out KL before training, and every candidate's score."""
    scores = {}
    for name, ids in candidate_layer_sets(target.model.config.num_hidden_layers, n).items():
        model = init_draft(target, ids)
        scores[name] = {"layers": list(ids), **evaluate(model, heldout, token_budget, max_len)}
        del model
    best = min(scores, key=lambda name: scores[name]["kl"])
    return tuple(scores[best]["layers"]), scores


def learning_rate(config, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of `lr` as `progress` goes 0 -> 1 (`config`: a DraftConfig)."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(model, records, heldout, config, kept: dict, checkpoint_path, state, deadline, log, progress) -> dict:
    """Distil until `config.steps` or `deadline`; checkpoints every few minutes and at the end. `kept`: what the
    checkpoint records of the build (its data plan, layers and their choice, the draft it started from)."""
    from tqdm import tqdm

    params = trainable(model)
    probe = heldout[: config.eval_sequences]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    else:
        state = {"step": 0, "train_seconds": 0.0}
        state["history"] = [{"step": 0, **evaluate(model, probe, config.batch_tokens, config.max_len)}]
    state.update(kept)

    def save() -> None:
        _save_checkpoint(checkpoint_path, model, optimizer, state)

    # training seconds this build may spend in all
    budget = max(1e-9, deadline - time.monotonic() + state["train_seconds"])
    schedule = _schedule(records, config)
    for _ in range(state["step"]):
        next(schedule)
    bar = tqdm(total=config.steps, initial=state["step"], desc="make-draft", unit="step", disable=not progress)
    last_save, began, seconds0 = time.monotonic(), time.monotonic(), state["train_seconds"]
    latest = state["history"][-1]
    while (config.steps is None or state["step"] < config.steps) and time.monotonic() < deadline:
        step = state["step"]
        done = step / config.steps if config.steps else (seconds0 + time.monotonic() - began) / budget
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, done)
        batch = collate([records[i] for i in next(schedule)], config.max_len, model.device)
        loss, agreed = _step(model, params, optimizer, batch, config)
        state["step"] = step + 1
        state["train_seconds"] = seconds0 + time.monotonic() - began
        if state["step"] % config.eval_every == 0:
            latest = {"step": state["step"], **evaluate(model, probe, config.batch_tokens, config.max_len)}
            state["history"].append(latest)
        bar.update(1)
        agree, heldout_agree = f"{agreed.float().mean().item():.2f}", f"{latest['agreement']:.3f}"
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=agree, heldout_agree=heldout_agree)
        if time.monotonic() - last_save > config.checkpoint_minutes * 60:
            save()
            last_save = time.monotonic()
    bar.close()
    save()
    log(f"trained {state['step']} steps in {state['train_seconds']:.0f}s")
    return state


def _step(model, params, optimizer, batch: TrainingBatch, config):
    """One optimiser step on `batch` (its matmuls in bf16 on a GPU, and on a CPU where `config.bf16()` says so);
    returns the loss and the batch's agreements."""
    device = model.device.type
    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda" or config.bf16()):
        loss, agreed = distill_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, agreed


def _save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    """The trainable weights, the optimiser and `state`, replaced atomically (a resumed build starts from it)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    weights = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    with atomic_path(path) as tmp:
        torch.save({**state, "model": weights, "optimizer": optimizer.state_dict(), "names": names}, tmp)


def _schedule(records, config):
    """Endless stream of batches (lists of record indices), epoch after epoch."""
    epoch = 0
    while True:
        yield from batches(records, config.batch_tokens, config.max_len, config.seed, epoch)
        epoch += 1
