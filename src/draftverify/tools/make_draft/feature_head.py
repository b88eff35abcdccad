"""`make-draft --kind head`: the target's replies and features -> a trained feature draft head.

Training (EAGLE with HASS / EAGLE-3's training-time test): at position t the head reads the
target's feature f_t and token t + 1 and predicts f_{t+1}; the loss is the cross-entropy
between the head's distribution over its vocabulary and the target's own (its LM head on the
true f_{t+1}, restricted to the same vocabulary), plus a small smooth-L1 term on the feature.
Drafting feeds the head its own predictions, so training does too: rollout step s >= 2 feeds
the head's step s - 1 prediction for position t as its input at t, attending the true inputs
before the draft began and the rolled-out inputs since, exactly as a draft of depth s does.

Resumable: the work folder holds the data cache (features.py) and `head-checkpoint.pt` (weights,
optimiser, step, history), written atomically every few minutes; the batch order is a pure
function of (seed, epoch), so a resumed build trains on the batches an uninterrupted one would.
"""

from __future__ import annotations

import math
import platform
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from draftverify.errors import require
from draftverify.feature_draft import FeatureDraft, HeadConfig
from draftverify.models import Loaded
from draftverify.prompt_files import read_prompts
from draftverify.tools.make_draft.data import load_checked
from draftverify.tools.make_draft.features import SAMPLED, FeatureCache, FeaturePlan, Sequence
from draftverify.util import atomic_path, atomic_write, eos_ids


@dataclass(frozen=True)
class HeadTraining:
    vocab: int = 8192  # N: the head drafts the N most frequent reply tokens (FR-Spec)
    rollout: int = 3  # training-time test depth (1 = plain teacher forcing, EAGLE-1)
    epochs: float = 2.0
    batch_tokens: int = 4096
    max_len: int = 384
    lr: float = 1e-3
    warmup: int = 20
    feature_weight: float = 0.1
    seed: int = 0
    budget_minutes: float = 110.0  # data + training wall clock
    data_share: float = 0.6  # part of the budget for making data (the cached data is always used)
    gen_batch: int = 64
    max_new_tokens: int = 96
    max_prompt_tokens: int = 256
    sampled: int = 0  # replies per prompt sampled besides the greedy one (features.SAMPLED)
    templates: int = (
        0  # more prompts written from the project's stdlib templates (code, summaries, ...), answered greedily
    )
    heldout: int = 64
    checkpoint_minutes: float = 3.0
    steps: int | None = None  # stop after this many optimiser steps (the schedule still spans the epochs)
    train_dtype: str = (
        "auto"  # the training forward's matmuls: fp32, bf16 (autocast; weights, optimiser, norms fp32) or auto
    )

    def __post_init__(self):
        require(self.vocab >= 16, f"--vocab {self.vocab} must be at least 16")
        require(1 <= self.rollout <= 8, f"rollout={self.rollout} must lie in 1..8")
        require(
            self.epochs > 0 and self.lr > 0 and self.budget_minutes > 0, "epochs, lr and the budget must be positive"
        )
        require(0 <= self.data_share < 1, f"data_share={self.data_share} must lie in [0, 1)")
        require(self.batch_tokens >= self.max_len >= 16, "batch_tokens must be >= max_len >= 16")
        require(self.sampled >= 0, f"--sampled {self.sampled} must be 0 or more")
        require(self.templates >= 0, f"--templates {self.templates} must be 0 or more")
        require(
            self.train_dtype in ("auto", "fp32", "bf16"),
            f"--train-dtype {self.train_dtype!r} is unknown: use auto, fp32 or bf16",
        )

    def autocast_bf16(self) -> bool:
        """Whether the training forward runs its matmuls in bf16: `auto` does where the CPU multiplies bf16 natively."""
        return self.train_dtype == "bf16" or (self.train_dtype == "auto" and native_bf16())


TRAINING_KEYS = (
    "vocab",
    "rollout",
    "batch_tokens",
    "max_len",
    "lr",
    "warmup",
    "feature_weight",
    "seed",
)  # what a resumed build must keep
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX): there a bf16 matmul runs several
    times faster than an fp32 one (a [4096, 576] x [576, 8192] product on a Zen 5 EPYC); elsewhere bf16 is emulated."""
    from draftverify.kernels import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


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


def rollout(head: FeatureDraft, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
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


def head_losses(head: FeatureDraft, ids, feats, lengths, starts, rollout_steps: int, feature_weight: float):
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


def batches(sequences: list[Sequence], config: HeadTraining, epoch: int) -> list[list[int]]:
    """Indices of each batch for `epoch`: similar lengths together, batch order shuffled by (seed, epoch)."""
    rng = random.Random(config.seed * 1_000_003 + epoch)
    order = sorted(range(len(sequences)), key=lambda i: (min(len(sequences[i].ids), config.max_len), rng.random()))
    out, cur, width = [], [], 0
    for i in order:
        n = min(len(sequences[i].ids), config.max_len)
        if cur and (len(cur) + 1) * max(width, n) > config.batch_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def acceptance(head: FeatureDraft, heldout: list[Sequence], config: HeadTraining) -> list[float]:
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


def template_cache(work: Path, plan: FeaturePlan, config: HeadTraining) -> FeatureCache | None:
    """The replies to `config.templates` prompts written from the project's stdlib templates (prompts.py: code tasks,
    "complete the code I provided", code review, summaries, math, ...; 4% of the shared training prompts ask for code),
    greedy only (more templates are as cheap as more samples, and more varied), in `work/features-templates` beside
    the replies to --prompts, which adding them keeps. A quarter as many held out as for --prompts."""
    if not config.templates:
        return None
    own = replace(plan, prompts=f"stdlib templates:{config.templates}", heldout=max(1, config.heldout // 4), sampled=0)
    return FeatureCache(work, own, subfolder="features-templates")


def template_prompts(config: HeadTraining) -> list[str]:
    from draftverify.tools.make_draft.prompts import Stdlib, make_prompts

    return make_prompts(config.templates, config.seed + 1, Stdlib.load())  # another stream than a draft model's prompts


def build_head(
    target: Loaded,
    out: Path,
    prompts: Path,
    config: HeadTraining = HeadTraining(),
    work: Path | None = None,
    resume: bool = False,
    command: str = "",
    log=print,
    progress: bool = True,
    save_dtype: str = "fp32",
    init: Path | None = None,
) -> dict:
    """Make data (the target's replies to `prompts`, and to template prompts if asked), train the head, write it to
    `out` with a model card. `init`: start from that head's weights and vocabulary (more training, e.g. on new data)
    instead of the target's last layer."""
    from tqdm.auto import tqdm

    require(save_dtype in SAVE_DTYPES, f"--save-dtype {save_dtype!r} is unknown: use one of {', '.join(SAVE_DTYPES)}")
    t_start = time.monotonic()
    work = Path(work) if work is not None else Path(out) / ".make-draft"
    ckpt_path = work / "head-checkpoint.pt"
    require(
        resume or not ckpt_path.exists(),
        f"{ckpt_path} exists from an earlier build: pass --resume to continue it, or delete {work}",
    )
    texts = [text for text, _ in read_prompts(prompts, at_least=2)]  # a head needs hundreds; two make a split
    plan = FeaturePlan(
        target=target.identity,
        prompts=f"{Path(prompts).name}:{len(texts)}",
        seed=config.seed,
        heldout=config.heldout,
        max_prompt_tokens=config.max_prompt_tokens,
        max_new_tokens=config.max_new_tokens,
        sampled=config.sampled,
    )
    cache, extra = FeatureCache(work, plan), template_cache(work, plan, config)
    caches = [cache] + ([extra] if extra else [])
    resumed = any(c.shards() for c in caches) or ckpt_path.exists()  # some of the build was made by an earlier run
    state = load_checked(ckpt_path, "checkpoint") if ckpt_path.exists() else None
    # `init`'s head, refused here if it is another target's (before any data is made)
    start = FeatureDraft.load(Path(init)).bind(target) if init is not None and not state else None
    origin = (
        state.get("init") if state else str(init) if init is not None else None
    )  # what the build's weights started from
    deadline = t_start + config.budget_minutes * 60
    if config.data_share > 0:
        data_deadline = t_start + config.data_share * config.budget_minutes * 60
        cache.fill(target, texts, config.gen_batch, data_deadline, log)
        if extra is not None and time.monotonic() < data_deadline:
            extra.fill(target, template_prompts(config), config.gen_batch, data_deadline, log)
    parts = [c.sequences() for c in caches]  # the replies to --prompts, then to the templates
    train, heldout = [s for part in parts for s in part], cache.heldout()
    require(train, f"no training data in {cache.folder}: raise --budget-minutes or --data-share")
    made = sum(len(s.ids) for s in train)
    log(
        f"training data: {len(train)} sequences, {made} tokens ({sum(len(s.ids) - s.start for s in train)} reply tokens)"
    )

    vocab = (
        state["vocab"]
        if state
        else list(start.config.vocab)
        if start
        else frequent_vocab(train, config.vocab, tuple(eos_ids(target)))
    )
    head = FeatureDraft(HeadConfig.for_target(target, vocab))
    head.bind(target)
    head.float()
    if state:
        same = {k: v for k, v in asdict(config).items() if k in TRAINING_KEYS}
        require(
            same == {k: state["config"].get(k) for k in TRAINING_KEYS},
            f"{ckpt_path} was made with other training settings: delete it or use them again",
        )
        head.load_state_dict(state["weights"])
    elif start is not None:
        head.load_state_dict(start.state_dict())
    else:
        head.init_from(target)
    head.train()
    head.embed, head.lm_head = head.embed.float(), head.lm_head.float()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if state:
        opt.load_state_dict(state["optimizer"])
    step, history = (state["step"], state["history"]) if state else (0, [])
    per_epoch = len(batches(train, config, 0))
    total = max(1, int(config.epochs * per_epoch))  # the learning-rate schedule's length
    stop = total if config.steps is None else min(total, config.steps)
    covered = sum(int(t in set(vocab)) for s in heldout for t in s.ids[s.start :].tolist()) / max(
        1, sum(len(s.ids) - s.start for s in heldout)
    )
    log(f"vocabulary: {len(vocab)} tokens cover {covered:.1%} of the held-out reply tokens; {total} steps")

    def save() -> None:
        with atomic_path(ckpt_path) as tmp:
            torch.save(
                {
                    "weights": head.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "history": history,
                    "vocab": vocab,
                    "config": asdict(config),
                    "init": origin,
                },
                tmp,
            )

    bf16 = config.autocast_bf16()
    log(f"training in {'bf16 (autocast)' if bf16 else 'fp32'}")
    bar = tqdm(total=stop, initial=step, desc="train head", unit="step", disable=not progress)
    last_save, seen = time.monotonic(), [0.0, 0]
    while step < stop and time.monotonic() < deadline:
        epoch, index = divmod(step, per_epoch)
        order = batches(train, config, epoch)
        ids, feats, lengths, starts = padded([train[i] for i in order[index]], config.max_len)
        lr = config.lr * min(1.0, (step + 1) / config.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, stats = head_losses(head, ids, feats, lengths, starts, config.rollout, config.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        seen[0] += float(loss.detach())
        seen[1] += 1
        bar.update(1)
        if step % 50 == 0 or step == stop:
            head.eval()
            acc = acceptance(head, heldout[:16], config)
            head.train()
            history.append({"step": step, "loss": seen[0] / seen[1], "heldout_top1": acc})
            seen = [0.0, 0]
            log(
                f"step {step}/{total}: loss {history[-1]['loss']:.3f}, held-out top-1 by depth "
                + " ".join(f"{a:.2f}" for a in acc)
            )
        if time.monotonic() - last_save > config.checkpoint_minutes * 60:
            save()
            last_save = time.monotonic()
    bar.close()
    save()
    head.eval()
    acc = acceptance(head, heldout, config)
    expected = sum(math.prod(acc[:d]) for d in range(1, len(acc) + 1))
    facts = {
        "command": command,
        "target": target.name,
        "identity": target.identity,
        "prompts": str(prompts),
        "sequences": len(train),
        "prompt_sequences": len(parts[0]),
        "templates": config.templates,
        "template_heldout_top1": acceptance(head, extra.heldout(), config) if extra else None,
        "init": origin,
        "tokens": made,
        "vocab": len(vocab),
        "vocab_coverage": covered,
        "steps": step,
        "of_steps": total,
        "minutes": (time.monotonic() - t_start) / 60,
        "heldout_top1": acc,
        "expected_chain": expected,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "training": asdict(config),
        "bf16": bf16,
        "resumed": resumed,
    }
    head.save(out, SAVE_DTYPES[save_dtype])
    atomic_write(Path(out) / "README.md", model_card(facts))
    log(
        f"wrote {out}: held-out top-1 by depth "
        + " ".join(f"{a:.2f}" for a in acc)
        + f"; expected chain {expected:.2f} tokens"
        + (" (template prompts: " + " ".join(f"{a:.2f}" for a in facts["template_heldout_top1"]) + ")" if extra else "")
    )
    return facts


def model_card(f: dict) -> str:
    acc = " / ".join(f"{a:.3f}" for a in f["heldout_top1"])
    sampled = f["training"].get("sampled", 0)
    replies = (
        "greedy"
        if not sampled
        else f"a greedy one and {sampled} sampled at T={SAMPLED['temperature']}, top-p {SAMPLED['top_p']} each"
    )
    templates = (
        f", and its greedy replies to {f['templates']} prompts written from the project's stdlib templates"
        if f.get("templates")
        else ""
    )
    init = f"\n- Started from the head in `{f['init']}` (its weights and vocabulary)" if f.get("init") else ""
    template_acc = (
        "\n- The same on held-out template prompts: " + " / ".join(f"{a:.3f}" for a in f["template_heldout_top1"])
        if f.get("template_heldout_top1")
        else ""
    )
    when = (
        f"resumed over several runs on {f['machine']} (each run logs its shards' and steps' times)"
        if f.get("resumed")
        else f"whole build {f['minutes']:.0f} minutes on {f['machine']}"
    )
    return f"""# Feature draft head for {f["target"]}

An EAGLE-style draft head (one decoder layer over the target's final hidden state and the next
token's embedding) with a frequency-ranked vocabulary of {f["vocab"]} tokens (FR-Spec), for
draftverify. It uses the target's own embeddings and LM head and is refused on any other model.

- Built with: `{f["command"]}`
- Data: the target's own replies to {f.get("prompt_sequences", f["sequences"]) // (1 + sampled)} prompts of `{f["prompts"]}` ({replies}){templates}; {f["tokens"]} tokens with features;
  the benchmark sets were never used.{init}
- Vocabulary coverage of held-out reply tokens: {f["vocab_coverage"]:.1%}
- Training: {f["steps"]} of {f["of_steps"]} steps ({"matmuls in bf16" if f.get("bf16") else "fp32"}{"; a resumed build's steps may mix" if f.get("resumed") else ""}); {when}
- Held-out top-1 agreement with the target at draft depth 1 / 2 / ...: {acc}
  (expected accepted chain, greedy: {f["expected_chain"]:.2f} tokens per round before the bonus token){template_acc}
- Settings: `{f["training"]}`
"""
