"""`draftverify make-draft`: build a draft for a target: a small draft model (distillation) or a
feature head (`--kind head`, trained on the target's own replies and hidden states)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import device_option, dtype_option, seed_option, target_option

# -- the options of `make-draft` ---------------------------------------------------

OUT = typer.Option(
    ..., "--out", "-o", help="Folder to write the draft into (a transformers model folder, or the head's folder)."
)
KIND = typer.Option(
    "model",
    help="model: a small draft model (some of the target's layers, distilled); head: a feature head "
    "(EAGLE-style, reads the target's hidden states; needs --prompts).",
)
PROMPTS = typer.Option(
    None,
    help="Instruction prompts (.jsonl with a prompt field, or .txt, one per line) the target answers to make the "
    "training data, e.g. ../shared/data/train_prompts/prompts.jsonl (--kind head needs them; --kind model: instead "
    "of the template prompts, answered by the engine).",
)
VOCAB = typer.Option(8192, help="--kind head: the head drafts this many of the most frequent reply tokens (FR-Spec).")
EPOCHS = typer.Option(
    8.0, help="--kind head: at most this many passes over the training data (the schedule fills the time left)."
)
SAMPLED = typer.Option(
    0,
    help="--kind head: replies per prompt sampled (T=0.8, top-p 0.95) besides the greedy one: more data from the same "
    "prompts.",
)
TEMPLATES = typer.Option(
    0,
    help="--kind head: this many more prompts written from the project's Python-stdlib templates (code tasks, "
    "'complete the code I provided', code review, summaries, math...), answered greedily; kept beside the --prompts "
    "data.",
)
INIT = typer.Option(
    None,
    help="Start from this draft's weights (e.g. to train on more data): --kind head: a head's weights and "
    "vocabulary instead of the target's last layer; --kind model: a draft folder made by make-draft for this target "
    "(its layers) instead of the target's layers.",
)
LAYERS = typer.Option(4, help="Decoder layers of the draft (copied from the target's, then trained).")
LAYER_IDS = typer.Option(
    None, help="Which target layers to copy, e.g. 0,1,2,29. Default: the best candidate set by held-out KL."
)
BUDGET_MINUTES = typer.Option(
    None,
    help="Wall-clock budget for making data and training; both stop cleanly when it runs out. Default: 45 (model), "
    "110 (head).",
)
DATA_SHARE = typer.Option(
    None,
    help="Part of the budget spent making new data shards; the cached ones are always used (0 = no new data, e.g. to "
    "only continue training). Default: 0.35 (model), 0.6 (head).",
)
DATA = typer.Option(
    "chat+text",
    help="New training data: chat (the target's replies to template prompts, or to --prompts), text (Python stdlib "
    "text) or chat+text (alternating shards). Cached shards are always used.",
)
STEPS = typer.Option(None, help="Stop training after this many steps (default: when the budget runs out).")
RESUME = typer.Option(False, help="Continue the build in the work folder from its last checkpoint.")
WORK = typer.Option(None, help="Folder for the data cache and checkpoints. Default: OUT/.make-draft.")
SHARE_EMBEDDINGS = typer.Option(
    False,
    help="Do not store the embeddings and head (the target's own): a much smaller folder that only draftverify can "
    "load, with its target.",
)
SAVE_DTYPE = typer.Option("fp32", help="Dtype of the saved weights: fp32, bf16 or fp16.")
TRAIN_DTYPE = typer.Option(
    "auto",
    help="The training matmuls on a CPU (and, --kind model, the scoring of --prompts replies): auto (bf16 where the "
    "CPU has bf16 instructions, else fp32), fp32 or bf16.",
)
BATCH_TOKENS = typer.Option(
    None, help="Tokens per training step. Default: 1024 (model), 4096 (head: at most; fewer for small data)."
)
LR = typer.Option(
    None, help="Peak learning rate (AdamW, warm-up then cosine decay). Default: 5e-4 (model), 1e-3 (head)."
)
GEN_BATCH = typer.Option(None, help="Prompts per batched generate when making data. Default: 16 (model), 64 (head).")
MAX_NEW_TOKENS = typer.Option(
    None, help="Tokens the target generates per training prompt. Default: 80 (model), 96 (head)."
)
WIDTH = typer.Option(
    0,
    help="--kind head: its MLP width (0: the widest whose fp16 weights fit the package's budget for a target's "
    "drafts, at most the target's own).",
)
HELDOUT = typer.Option(
    None,
    help="Held-out prompts (the target's greedy replies) that measure the draft's agreement. Default: 32 (model), 64 "
    "(head).",
)


def make_draft(
    out: Path = OUT,
    kind: str = KIND,
    prompts: Optional[Path] = PROMPTS,
    vocab: int = VOCAB,
    width: int = WIDTH,
    epochs: float = EPOCHS,
    sampled: int = SAMPLED,
    templates: int = TEMPLATES,
    init: Optional[Path] = INIT,
    target: Optional[str] = target_option(),
    layers: int = LAYERS,
    layer_ids: Optional[str] = LAYER_IDS,
    budget_minutes: Optional[float] = BUDGET_MINUTES,
    data_share: Optional[float] = DATA_SHARE,
    data: str = DATA,
    steps: Optional[int] = STEPS,
    seed: int = seed_option("the prompts, the data order and sampling"),
    resume: bool = RESUME,
    work: Optional[Path] = WORK,
    share_embeddings: bool = SHARE_EMBEDDINGS,
    save_dtype: str = SAVE_DTYPE,
    train_dtype: str = TRAIN_DTYPE,
    batch_tokens: Optional[int] = BATCH_TOKENS,
    lr: Optional[float] = LR,
    gen_batch: Optional[int] = GEN_BATCH,
    max_new_tokens: Optional[int] = MAX_NEW_TOKENS,
    heldout: Optional[int] = HELDOUT,
    dtype: str = dtype_option("Target weights dtype"),
    device: str = device_option(),
):
    """Build a draft for a target. `--kind model`: its embeddings and a few of its layers, distilled on the
    target's own replies and Python stdlib text (a transformers folder with a model card). `--kind head`:
    a feature head trained on the target's replies to --prompts and its hidden states."""
    from draftverify.errors import require
    from draftverify.loading import load_model

    require(kind in ("model", "head"), f"--kind {kind!r} is unknown: use model or head")
    require(
        kind == "model" or prompts is not None,
        "--kind head needs --prompts FILE (e.g. ../shared/data/train_prompts/prompts.jsonl)",
    )
    given = dict(budget_minutes=budget_minutes, data_share=data_share, batch_tokens=batch_tokens, lr=lr, seed=seed)
    given |= dict(gen_batch=gen_batch, max_new_tokens=max_new_tokens, heldout=heldout, train_dtype=train_dtype)
    given = {k: v for k, v in given.items() if v is not None}  # the rest: the kind's own defaults
    loaded = load_model(target, dtype=dtype, device=device, direct=False)
    command = "draftverify make-draft " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "make-draft")
    build = dict(work=work, resume=resume, command=command, log=_log, save_dtype=save_dtype, init=init)
    if kind == "head":
        from draftverify.tools.make_draft.feature_head import HeadTraining, build_head

        own = dict(vocab=vocab, width=width, epochs=epochs, sampled=sampled, templates=templates)
        build_head(loaded, out, prompts, HeadTraining(**own, steps=steps, **given), **build)
    else:
        from draftverify.tools.make_draft.build import build_draft

        config = _draft_config(layers, layer_ids, steps, data, given)
        engine = _engine(target, dtype, device) if prompts is not None else None  # answers --prompts
        build_draft(loaded, out, config, share_embeddings=share_embeddings, prompts=prompts, engine=engine, **build)


def _engine(target: str | None, dtype: str, device: str):
    """An engine on the target's fast path (a GGUF file's own kernels) that answers --prompts for a draft model."""
    from draftverify.engine import Engine, load_target

    direct, arithmetic = load_target(target, dtype, device)
    return Engine(direct, arithmetic=arithmetic)


def _draft_config(layers: int, layer_ids: str | None, steps, data: str, given: dict):
    """`--kind model`'s settings: `layer_ids` (comma-separated) name the copied layers, else `layers` count them."""
    from draftverify.tools.make_draft.build import DraftConfig

    ids = tuple(int(x) for x in layer_ids.split(",")) if layer_ids else None
    own = {("heldout_prompts" if k == "heldout" else k): v for k, v in given.items()}
    return DraftConfig(
        layers=len(ids) if ids else layers, layer_ids=ids, steps=steps, data=data, max_shards=None, **own
    )


def _log(message: str) -> None:
    typer.echo(message, err=True)
