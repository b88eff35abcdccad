"""`make-draft --kind head`: the target's replies and features -> a trained feature head (EAGLE-style).

Training (EAGLE with HASS / EAGLE-3's training-time test): at position t the head reads the
target's feature f_t and token t + 1 and predicts f_{t+1}; the loss is the cross-entropy
between the head's distribution over its vocabulary and the target's own (its LM head on the
true f_{t+1}, restricted to the same vocabulary), plus a small smooth-L1 term on the feature.
Drafting feeds the head its own predictions, so training does too: rollout step s >= 2 feeds
the head's step s - 1 prediction for position t as its input at t, attending the true inputs
before the draft began and the rolled-out inputs since, exactly as a draft of depth s does.

Schedule (feature_schedule.py): the batch shrinks for small data, the number of steps fills the time left (at
most `epochs` epochs); the head is evaluated on held-out replies every few steps and the best evaluated weights
are written. Resumable: the work folder holds the data cache (features.py) and `head-checkpoint.pt` (weights,
optimiser, step, history, the schedule's length and batch, the best weights so far), written atomically every few
minutes; the batch order is a pure function of (seed, epoch), so a resumed build trains on the batches an
uninterrupted one would.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from draftverify.errors import require
from draftverify.feature_head import FeatureHead, HeadConfig
from draftverify.loading import Loaded
from draftverify.prompt_files import read_prompts
from draftverify.tools.make_draft.data import load_checked
from draftverify.tools.make_draft.feature_card import model_card
from draftverify.tools.make_draft.feature_losses import acceptance, batches, frequent_vocab, head_losses, padded
from draftverify.tools.make_draft.feature_schedule import (
    TIMED_STEPS,
    epoch_batch_tokens,
    eval_every,
    expected_chain,
    learning_rate,
    schedule_length,
)
from draftverify.tools.make_draft.feature_settings import SAVE_DTYPES, TRAINING_KEYS, HeadTraining, head_width
from draftverify.tools.make_draft.features import FeatureCache, FeaturePlan, Sequence
from draftverify.util import atomic_path, atomic_write, eos_ids


def template_cache(work: Path, plan: FeaturePlan, config: HeadTraining) -> FeatureCache | None:
    """The replies to `config.templates` prompts written from the project's stdlib templates (prompts.py: code tasks,
    "complete the code I provided", code review, summaries, math, ...: few of the shared training prompts ask for code),
    greedy only (more templates are as cheap as more samples, and more varied), in `work/features-templates` beside
    the replies to --prompts, which adding them keeps. A quarter as many held out as for --prompts."""
    if not config.templates:
        return None
    own = replace(plan, prompts=f"stdlib templates:{config.templates}", heldout=max(1, config.heldout // 4), sampled=0)
    return FeatureCache(work, own, subfolder="features-templates")


def template_prompts(config: HeadTraining) -> list[str]:
    from draftverify.tools.make_draft.prompts import Stdlib, make_prompts

    return make_prompts(config.templates, config.seed + 1, Stdlib.load())  # another stream than a draft model's prompts


@dataclass
class TrainingData:
    """The build's sequences: the replies to --prompts (`caches[0]`, whose held-out part measures the head), then
    to the template prompts (`caches[1]`, if asked)."""

    caches: list[FeatureCache]
    parts: list[list[Sequence]]  # per cache, its training sequences
    resumed: bool  # whether an earlier run had made some of the data

    @property
    def train(self) -> list[Sequence]:
        return [s for part in self.parts for s in part]

    @property
    def heldout(self) -> list[Sequence]:
        return self.caches[0].heldout()

    @property
    def extra(self) -> FeatureCache | None:
        return self.caches[1] if len(self.caches) > 1 else None


@dataclass
class Run:
    """A build's training state, checkpointed atomically to `path` (a resumed build continues from it)."""

    path: Path
    config: HeadTraining
    head: FeatureHead
    opt: torch.optim.Optimizer
    vocab: list[int]
    origin: str | None  # what the weights started from: None (the target's last layer) or an --init head
    step: int = 0
    history: list[dict] = field(default_factory=list)
    total: int | None = None  # the schedule's length, fixed once the first steps are timed
    batch_tokens: int = 0  # the padded tokens a step may hold (feature_schedule.epoch_batch_tokens)
    best: dict | None = None  # the best scheduled evaluation: its step, expected chain and weights

    def save(self) -> None:
        state = {"weights": self.head.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step}
        state |= {"history": self.history, "vocab": self.vocab, "config": asdict(self.config), "init": self.origin}
        state |= {"total": self.total, "batch_tokens": self.batch_tokens, "best": self.best}
        with atomic_path(self.path) as tmp:
            torch.save(state, tmp)


def training_data(
    target: Loaded, prompts: Path, config: HeadTraining, work: Path, t_start: float, log, runner=None
) -> TrainingData:
    """The replies and features of --prompts (and of template prompts if asked), made until the data deadline
    (a share of the budget) on top of what the work folder already holds; `runner`: see `FeatureCache.fill`."""
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
    resumed = any(c.shards() for c in caches)
    if config.data_share > 0:
        data_deadline = t_start + config.data_share * config.budget_minutes * 60
        cache.fill(target, texts, config.gen_batch, data_deadline, log, runner)
        if extra is not None and time.monotonic() < data_deadline:
            extra.fill(target, template_prompts(config), config.gen_batch, data_deadline, log, runner)
    return TrainingData(caches, [c.sequences() for c in caches], resumed)


def start_run(
    target: Loaded, config: HeadTraining, data: TrainingData, path: Path, init: Path | None, start: FeatureHead | None
) -> Run:
    """The head and optimiser to train: from the checkpoint at `path` if there is one (its settings must match),
    else from `start` (the head at `init`), else from the target's last layer."""
    state = load_checked(path, "checkpoint") if path.exists() else None
    if state:
        vocab = state["vocab"]
    else:
        vocab = list(start.config.vocab) if start else frequent_vocab(data.train, config.vocab, eos_ids(target))
    if state:
        width = state["weights"]["down.weight"].shape[1]
    else:
        width = start.config.intermediate_size if start else head_width(target.model.config, config.width)
    head = FeatureHead(HeadConfig.for_target(target, vocab, width))
    head.bind(target)
    head.float()
    if state:
        same = {k: v for k, v in asdict(config).items() if k in TRAINING_KEYS}
        require(
            same == {k: state["config"].get(k) for k in TRAINING_KEYS},
            f"{path} was made with other training settings: delete it or use them again",
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
    origin = state.get("init") if state else str(init) if init is not None else None
    run = Run(path, config, head, opt, vocab, origin)
    if state:
        opt.load_state_dict(state["optimizer"])
        run.step, run.history = state["step"], state["history"]
        run.total, run.batch_tokens, run.best = state.get("total"), state.get("batch_tokens", 0), state.get("best")
    run.batch_tokens = run.batch_tokens or epoch_batch_tokens(data.train, config)
    return run


def train_steps(run: Run, train: list[Sequence], heldout: list[Sequence], deadline: float, log, progress: bool):
    """Optimiser steps until the schedule's end, `config.steps` or the deadline; the schedule's length fixed after
    TIMED_STEPS steps (`schedule_length`), held-out evaluations every `eval_every` steps, checkpoints every
    `checkpoint_minutes`. The last weights are evaluated too (as a candidate for the written head only)."""
    from tqdm.auto import tqdm

    config = run.config
    per_epoch = len(batches(train, config, 0, run.batch_tokens))
    cap = max(1, int(config.epochs * per_epoch))  # the provisional length until the steps are timed
    bar = tqdm(total=run.total or cap, initial=run.step, desc="train head", unit="step", disable=not progress)
    last_save, seen, timed = time.monotonic(), [0.0, 0], None  # timed: (time, step) after this run's first step
    while run.step < min(run.total or cap, config.steps if config.steps is not None else cap):
        if time.monotonic() >= deadline:
            break
        epoch, index = divmod(run.step, per_epoch)
        loss = _step(run, train, batches(train, config, epoch, run.batch_tokens)[index], run.total or cap)
        run.step += 1
        seen = [seen[0] + loss, seen[1] + 1]
        bar.update(1)
        timed = timed or (time.monotonic(), run.step)  # the first step (allocations, warm caches) is not timed
        if run.total is None and (run.step - timed[1] >= TIMED_STEPS or run.step >= cap):
            per_step = (time.monotonic() - timed[0]) / max(1, run.step - timed[1])
            run.total = schedule_length(per_epoch, config.epochs, run.step, per_step, deadline - time.monotonic())
            bar.total = run.total
            log(f"schedule: {run.total} steps of up to {run.batch_tokens} tokens ({per_epoch} an epoch)")
        if run.total is not None and (run.step % eval_every(run.total) == 0 or run.step == run.total):
            _evaluate(run, heldout, seen, log, scheduled=True)
            seen = [0.0, 0]
        if time.monotonic() - last_save > config.checkpoint_minutes * 60:
            run.save()
            last_save = time.monotonic()
    bar.close()
    if run.step > 0 and (not run.history or run.history[-1]["step"] != run.step):
        _evaluate(run, heldout, seen, log, scheduled=False)
    run.save()


def _step(run: Run, train: list[Sequence], batch: list[int], total: int) -> float:
    """One optimiser step on the sequences `batch` indexes, at the schedule's learning rate; returns its loss."""
    config, head = run.config, run.head
    ids, feats, lengths, starts = padded([train[i] for i in batch], config.max_len)
    for group in run.opt.param_groups:
        group["lr"] = learning_rate(config, run.step, total)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast_bf16()):
        loss, _ = head_losses(head, ids, feats, lengths, starts, config.rollout, config.feature_weight)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 0.5)
    run.opt.step()
    return float(loss.detach())


def _evaluate(run: Run, heldout: list[Sequence], seen: list, log, scheduled: bool) -> None:
    """Held-out top-1 on the first 16 held-out replies, logged in the history; a scheduled evaluation (the same
    steps in a resumed build as in an uninterrupted one) keeps the weights if their expected chain is the best."""
    run.head.eval()
    acc = acceptance(run.head, heldout[:16], run.config)
    run.head.train()
    chain = expected_chain(acc)
    loss = seen[0] / seen[1] if seen[1] else None
    run.history.append({"step": run.step, "loss": loss, "heldout_top1": acc, "expected_chain": chain})
    shown = f"loss {loss:.3f}, " if loss is not None else ""
    log(f"step {run.step}/{run.total}: {shown}held-out top-1 by depth {_rates(acc)}, expected chain {chain:.2f}")
    if scheduled and (run.best is None or chain > run.best["expected_chain"]):
        weights = {k: v.detach().clone() for k, v in run.head.state_dict().items()}
        run.best = {"step": run.step, "expected_chain": chain, "weights": weights}


def keep_best(run: Run) -> int:
    """Load the best evaluated weights into the head (the best scheduled evaluation's, unless the last weights did as
    well); returns the step they are from."""
    last = run.history[-1] if run.history and run.history[-1]["step"] == run.step else None
    if run.best is not None and (last is None or run.best["expected_chain"] > expected_chain(last["heldout_top1"])):
        run.head.load_state_dict(run.best["weights"])
        return run.best["step"]
    return run.step


def _rates(values: list[float]) -> str:
    return " ".join(f"{a:.2f}" for a in values)


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
    runner=None,
) -> dict:
    """Make data (the target's replies to `prompts`, and to template prompts if asked), train the head, write it to
    `out` with a model card. `init`: start from that head's weights and vocabulary (more training, e.g. on new data)
    instead of the target's last layer. `runner`: the target's runner to make the data on (an engine's, in its
    arithmetic; `FeatureCache.fill`)."""
    require(save_dtype in SAVE_DTYPES, f"--save-dtype {save_dtype!r} is unknown: use one of {', '.join(SAVE_DTYPES)}")
    t_start = time.monotonic()
    work = Path(work) if work is not None else Path(out) / ".make-draft"
    path = work / "head-checkpoint.pt"
    require(
        resume or not path.exists(),
        f"{path} exists from an earlier build: pass --resume to continue it, or delete {work}",
    )
    resumed = path.exists()  # an earlier run trained some of it (or made some of the data: below)
    # `init`'s head, refused here if it is another target's (before any data is made)
    start = FeatureHead.load(Path(init)).bind(target) if init is not None and not resumed else None
    data = training_data(target, prompts, config, work, t_start, log, runner)
    train, heldout = data.train, data.heldout
    require(train, f"no training data in {data.caches[0].folder}: raise --budget-minutes or --data-share")
    made = sum(len(s.ids) for s in train)
    replies = sum(len(s.ids) - s.start for s in train)
    log(f"training data: {len(train)} sequences, {made} tokens ({replies} reply tokens)")
    run = start_run(target, config, data, path, init, start)
    vocab = set(run.vocab)
    reply = [t for s in heldout for t in s.ids[s.start :].tolist()]
    covered = sum(t in vocab for t in reply) / max(1, len(reply))
    log(f"vocabulary: {len(run.vocab)} tokens cover {covered:.1%} of the held-out reply tokens")
    log(f"training in {'bf16 (autocast)' if config.autocast_bf16() else 'fp32'}")
    train_steps(run, train, heldout, t_start + config.budget_minutes * 60, log, progress)
    kept = keep_best(run)
    run.head.eval()
    acc, extra = acceptance(run.head, heldout, config), data.extra
    facts = {"command": command, "target": target.name, "identity": target.identity, "prompts": str(prompts)}
    facts |= {"sequences": len(train), "prompt_sequences": len(data.parts[0]), "templates": config.templates}
    facts |= {"template_heldout_top1": acceptance(run.head, extra.heldout(), config) if extra else None}
    facts |= {"init": run.origin, "tokens": made, "vocab": len(run.vocab), "vocab_coverage": covered}
    facts |= {"steps": run.step, "of_steps": run.total, "kept_step": kept, "batch_tokens": run.batch_tokens}
    facts |= {"minutes": (time.monotonic() - t_start) / 60, "heldout_top1": acc, "expected_chain": expected_chain(acc)}
    facts |= {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "training": asdict(config)}
    facts |= {"bf16": config.autocast_bf16(), "resumed": resumed or data.resumed}
    run.head.save(out, SAVE_DTYPES[save_dtype])
    atomic_write(Path(out) / "README.md", model_card(facts))
    templates = f" (template prompts: {_rates(facts['template_heldout_top1'])})" if extra else ""
    chain = f"expected chain {facts['expected_chain']:.2f} tokens"
    log(f"wrote {out}: held-out top-1 by depth {_rates(acc)}; {chain}{templates}")
    return facts
