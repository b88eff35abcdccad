"""`build_draft`: data -> layer choice -> distillation -> a transformers folder with a model card.

The work folder holds the data cache (`data/`, see data.py) and `checkpoint.pt` (the trained
tensors, the optimiser state, the step and the evaluation history), both written atomically. A
build with `resume=True` picks up the cached data and the last checkpoint; the batch order is a
pure function of (seed, epoch), so a resumed build trains on exactly the batches an
uninterrupted one would have. The wall-clock budget is split between making data
(`data_share`, 0 = use the cached data only) and training; whichever phase runs out of time
stops after its current batch.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.loading import DRAFT_META_FILE, Loaded, tokenizer_fingerprint
from draftverify.models import Runner
from draftverify.tools.make_draft.data import DataCache, DataPlan, Prompts, load_checked
from draftverify.tools.make_draft.draft_card import model_card
from draftverify.tools.make_draft.feature_settings import native_bf16
from draftverify.tools.make_draft.train import choose_layers, evaluate, init_draft, train
from draftverify.util import atomic_path

DATA_SOURCES = {"chat": 0, "text": 1, "chat+text": 2}  # -> text_every: every n-th new shard is stdlib text


@dataclass(frozen=True)
class DraftConfig:
    layers: int = 4  # decoder layers of the draft
    layer_ids: tuple[int, ...] | None = None  # which target layers to copy (None: pick by measurement)
    budget_minutes: float = 45.0  # wall clock for data + training
    data_share: float = 0.35  # part of the budget spent making new data
    steps: int | None = None  # stop after this many optimiser steps (None: when the budget runs out)
    max_shards: int | None = None  # stop making data after this many shards (None: when its budget runs out)
    data: str = "chat+text"  # chat (the target's generations), text (stdlib text) or both
    seed: int = 0
    topk: int = 32  # target probabilities kept per position
    gen_batch: int = 16  # prompts per batched generate
    max_new_tokens: int = 80  # tokens generated per prompt
    heldout_prompts: int = 32
    batch_tokens: int = 1024  # tokens per optimiser step
    max_len: int = 512  # sequences are cut to this many tokens
    lr: float = 5e-4
    warmup: int = 10
    eval_every: int = 25
    eval_sequences: int = 8  # held-out sequences scored during training and for the layer choice (all at the end)
    checkpoint_minutes: float = 4.0
    train_dtype: str = "auto"  # the training forward's matmuls on a CPU: fp32, bf16 (autocast) or auto (bf16 if native)

    def __post_init__(self):
        require(self.layers >= 1, f"--layers {self.layers} must be at least 1")
        require(
            self.layer_ids is None or len(self.layer_ids) == self.layers,
            "--layer-ids must name exactly --layers layers",
        )
        require(self.budget_minutes > 0, f"--budget-minutes {self.budget_minutes} must be positive")
        require(0 <= self.data_share < 1, f"data_share={self.data_share} must lie in [0, 1)")
        require(self.steps is None or self.steps >= 0, f"--steps {self.steps} must be >= 0")
        require(self.data in DATA_SOURCES, f"--data {self.data!r} is unknown: use one of {', '.join(DATA_SOURCES)}")
        require(
            self.topk >= 1 and self.gen_batch >= 1 and self.max_new_tokens >= 1,
            "topk, gen_batch and max_new_tokens must be >= 1",
        )
        require(self.heldout_prompts >= 1, "heldout_prompts must be >= 1")
        require(self.batch_tokens >= 16 and self.max_len >= 16, "batch_tokens and max_len must be >= 16")
        require(self.lr > 0, f"--lr {self.lr} must be positive")
        require(
            self.train_dtype in ("auto", "fp32", "bf16"),
            f"--train-dtype {self.train_dtype!r} is unknown: use auto, fp32 or bf16",
        )

    def bf16(self) -> bool:
        """Whether the training forward (and the scoring of --prompts replies) runs its matmuls in bf16 on a CPU."""
        return self.train_dtype == "bf16" or (self.train_dtype == "auto" and native_bf16())


def build_draft(
    target: Loaded,
    out: Path,
    config: DraftConfig = DraftConfig(),
    work: Path | None = None,
    resume: bool = False,
    share_embeddings: bool = False,
    save_dtype: str = "fp32",
    command: str = "",
    log=print,
    progress: bool = True,
    prompts: Path | None = None,
    engine=None,
    init: Path | None = None,
) -> dict:
    """Build a draft for `target` into the folder `out`; returns the facts written into its model card.

    `prompts`: a prompt file whose replies are the chat data instead of the template prompts', answered by
    `engine` (an `Engine` on the target; default: one on `target` itself). `init`: a draft folder (made by this tool
    for this target) whose layers and weights training starts from instead of the target's layers."""
    start = time.monotonic()
    deadline = start + config.budget_minutes * 60
    out, work = Path(out), Path(work) if work is not None else Path(out) / ".make-draft"
    checkpoint_path = work / "checkpoint.pt"
    require(
        resume or not checkpoint_path.exists(),
        f"{checkpoint_path} exists from an earlier build: pass --resume to continue it, or delete {work}",
    )
    torch.manual_seed(config.seed)
    asked = Prompts.read(prompts, engine or _engine(target), config.heldout_prompts, config.seed) if prompts else None
    plan = DataPlan(target.identity, config.seed, config.topk, asked.label if asked else "")
    records, data_summary, heldout = _training_data(target, DataCache(work, plan), config, start, log, asked)
    state = _checkpoint(checkpoint_path, plan, config, work)
    model, kept = _start(target, config, state, heldout, init, log)
    state = train(
        model, records, heldout, config, {"plan": asdict(plan), **kept}, checkpoint_path, state, deadline, log, progress
    )

    final = evaluate(model, heldout, config.batch_tokens, config.max_len)
    model.eval().requires_grad_(False)
    cost = relative_cost(model, target.model)
    facts = {
        "target": target.name,
        "target_identity": target.identity,
        "layers": kept["layer_ids"],
        "layer_choice": kept["layer_scores"],
        **_training_facts(target, config, state, data_summary),
        "heldout": {"sequences": len(heldout), **final},
        "relative_forward_cost": cost,
        "command": command,
        "prompts": str(prompts) if prompts is not None else None,
        "init": kept["init"],
    }
    write_folder(model, target, out, facts, share_embeddings, save_dtype)
    log(
        f"draft written to {out}: held-out greedy agreement {final['agreement']:.3f}, forward cost "
        f"{cost['ratio']:.2f}x the target's"
    )
    return facts


def _training_facts(target: Loaded, config: DraftConfig, state: dict, data: dict) -> dict:
    """The model card's facts of the training: steps, seconds, where and in which arithmetic, data, history."""
    return {
        "steps": state["step"],
        "train_seconds": round(state["train_seconds"]),
        "device": _device_name(target),
        "bf16": config.bf16() and target.device.type == "cpu",
        "data": data,
        "history": state["history"],
        "config": asdict(config),
    }


def _checkpoint(path: Path, plan: DataPlan, config: DraftConfig, work: Path) -> dict | None:
    """The checkpoint a resumed build continues from (None: none yet), refused if made for another plan."""
    if not path.exists():
        return None
    state = load_checked(path, "checkpoint")
    require(
        state.get("plan") == asdict(plan) and state.get("layers") == config.layers,
        f"checkpoint {path} belongs to another target or settings: delete {work} or use another --work",
    )
    return state


def _engine(target: Loaded):
    """An engine on `target` that answers --prompts (the CLI passes one on the target's fast path instead)."""
    from draftverify.engine import Engine

    return Engine(target)


def _start(target: Loaded, config: DraftConfig, state: dict | None, heldout, init: Path | None, log):
    """The draft training starts from (the target's layers, or --init's draft; a resumed build's checkpoint loads in
    `train`), and what the checkpoint keeps of that choice: layers, layer ids and scores, the --init folder."""
    started = _init_weights(init, target, config) if init is not None and state is None else None
    if started is not None:
        layer_ids, layer_scores = started["layers"], started["layer_choice"]
    else:
        layer_ids, layer_scores = _layers(target, config, state, heldout, log)
    model = init_draft(target, layer_ids)
    if started is not None:
        model.load_state_dict(started["weights"], strict=False)
    origin = state.get("init") if state is not None else (str(init) if init is not None else None)
    kept = {"layers": config.layers, "layer_ids": list(layer_ids), "layer_scores": layer_scores, "init": origin}
    return model, kept


def _device_name(target: Loaded) -> str:
    """Where the draft was trained, for its model card (the CPU's name and threads, or the GPU)."""
    if target.device.type != "cpu":
        return str(target.device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _init_weights(init: Path, target: Loaded, config: DraftConfig) -> dict:
    """A draft folder's layer ids, layer-choice scores and trainable weights, to start training from."""
    from safetensors.torch import load_file

    from draftverify.util import same_weights

    meta_path, weights_path = Path(init) / DRAFT_META_FILE, Path(init) / "model.safetensors"
    require(
        meta_path.is_file() and weights_path.is_file(),
        f"--init {init} is not a draft folder made by make-draft (no {DRAFT_META_FILE} or model.safetensors)",
    )
    try:
        meta = json.loads(meta_path.read_text())
        built_for, layers = dict(meta["target"]), tuple(int(i) for i in meta["facts"]["layers"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftVerifyError(f"{meta_path} is corrupt: rebuild that draft or start without --init") from exc
    require(same_weights(built_for, target.identity), f"--init {init} was built for another target: drop --init")
    require(
        len(layers) == config.layers and config.layer_ids in (None, layers),
        f"--init {init} copies the target's layers {list(layers)}: pass --layers {len(layers)} and no --layer-ids",
    )
    weights = {k: v.float() for k, v in load_file(weights_path).items()}
    return {"layers": layers, "layer_choice": meta["facts"].get("layer_choice", {}), "weights": weights}


def _training_data(
    target: Loaded, cache: DataCache, config: DraftConfig, start: float, log, prompts: Prompts | None = None
):
    """The training records (made until the data share of the budget, on top of the cached ones), the data's
    summary and the held-out sequences."""
    if config.data_share > 0 or not cache.shards():
        cache.fill(
            target,
            start + config.budget_minutes * 60 * config.data_share,
            config.heldout_prompts,
            config.gen_batch,
            config.max_new_tokens,
            DATA_SOURCES[config.data],
            config.max_shards,
            log,
            prompts,
            config.bf16() and target.device.type == "cpu",
        )
    records, summary = cache.records()
    require(
        records, f"no training data was made within the budget: raise --budget-minutes (data cache: {cache.folder})"
    )
    return records, summary, cache.heldout()


def _layers(target: Loaded, config: DraftConfig, state: dict | None, heldout, log) -> tuple[tuple[int, ...], dict]:
    """Which target layers the draft copies: the checkpoint's, else --layer-ids, else the best by held-out KL."""
    if state is not None:
        return tuple(state["layer_ids"]), state["layer_scores"]
    if config.layer_ids is not None:
        return tuple(config.layer_ids), {}
    layer_ids, layer_scores = choose_layers(
        target, config.layers, heldout[: config.eval_sequences], config.batch_tokens, config.max_len
    )
    log(
        "layer choice (held-out KL before training): "
        + ", ".join(f"{k} {v['layers']} {v['kl']:.3f}" for k, v in layer_scores.items())
    )
    return layer_ids, layer_scores


@torch.no_grad()
def relative_cost(draft: torch.nn.Module, target: torch.nn.Module, reps: int = 30, prefix: int = 64) -> dict:
    """Median seconds of a one-token forward against a `prefix`-token cache, draft and target interleaved."""
    runners = {"draft": Runner(draft), "target": Runner(target)}
    times = {name: [] for name in runners}
    vocab = target.config.vocab_size
    for runner in runners.values():
        runner.forward([(10 + i) % vocab for i in range(prefix)])
    for i in range(reps):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner.forward([(100 + i) % vocab])
            times[name].append(time.perf_counter() - t0)
            runner.crop(prefix)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "draft_s": medians["draft"],
        "target_s": medians["target"],
        "ratio": medians["draft"] / medians["target"],
        "reps": reps,
    }


def write_folder(model, target: Loaded, out: Path, facts: dict, share_embeddings: bool, save_dtype: str) -> None:
    """config, safetensors weights, tokenizer, generation config, draftverify.json and README.md, each replaced
    atomically."""
    from safetensors.torch import save_file

    from draftverify.loading import DTYPES

    require(save_dtype in DTYPES, f"--save-dtype {save_dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    out.mkdir(parents=True, exist_ok=True)
    in_key, out_key = (_weight_name(model, m) for m in (model.get_input_embeddings(), model.get_output_embeddings()))
    skip = ({in_key, out_key} if share_embeddings else set()) | (
        {out_key} if model.config.tie_word_embeddings else set()
    )
    state = {
        n: t.detach().to("cpu", DTYPES[save_dtype]).contiguous() for n, t in model.state_dict().items() if n not in skip
    }
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    facts = {
        **facts,
        "share_embeddings": share_embeddings,
        "save_dtype": save_dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "own_parameters": sum(p.numel() for p in model.parameters() if id(p) not in embeddings),
    }
    with atomic_path(out, folder=True) as tmp:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        facts["file_mb"] = round((tmp / "model.safetensors").stat().st_size / 2**20, 1)
        config = model.config
        config.dtype = DTYPES[save_dtype]
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        meta = {
            "made_by": "draftverify make-draft",
            "target": target.identity,
            "shared_embeddings": share_embeddings,
            "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "facts": facts,
        }
        (tmp / DRAFT_META_FILE).write_text(json.dumps(meta, indent=1))
        (tmp / "README.md").write_text(model_card(facts))


def _weight_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module) + ".weight"
