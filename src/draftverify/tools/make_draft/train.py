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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from draftverify.errors import require
from draftverify.loading import Loaded, layer_prefix
from draftverify.tools.make_draft.data import TrainingRecord


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
