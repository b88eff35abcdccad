"""`draftverify make-draft`: build a draft for a target: a small draft model (distillation) or a
feature draft head (`--kind head`, trained on the target's own replies and hidden states)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import device_option, dtype_option, seed_option, target_option


def make_draft(
    out: Path = typer.Option(
        ..., "--out", "-o", help="Folder to write the draft into (a transformers model folder, or the head's folder)."
    ),
    kind: str = typer.Option(
        "model",
        help="model: a small draft model (some of the target's layers, distilled); head: a feature draft head "
        "(EAGLE-style, reads the target's hidden states; needs --prompts).",
    ),
    prompts: Optional[Path] = typer.Option(
        None,
        help="--kind head: instruction prompts (JSON lines with a 'prompt' field) the target "
        "answers to make the training data, e.g. ../shared/data/train_prompts/prompts.jsonl.",
    ),
    vocab: int = typer.Option(
        8192, help="--kind head: the head drafts this many of the most frequent reply tokens (FR-Spec)."
    ),
    epochs: float = typer.Option(2.0, help="--kind head: passes over the training data."),
    sampled: int = typer.Option(
        0,
        help="--kind head: replies per prompt sampled (T=0.8, top-p 0.95) besides the greedy one: more data from the same prompts.",
    ),
    templates: int = typer.Option(
        0,
        help="--kind head: this many more prompts written from the project's Python-stdlib templates (code tasks, "
        "'complete the code I provided', code review, summaries, math...), answered greedily; kept beside the --prompts data.",
    ),
    init: Optional[Path] = typer.Option(
        None,
        help="--kind head: start from this head's weights and vocabulary (e.g. to train on more data) "
        "instead of the target's last layer.",
    ),
    target: Optional[str] = target_option(),
    layers: int = typer.Option(4, help="Decoder layers of the draft (copied from the target's, then trained)."),
    layer_ids: Optional[str] = typer.Option(
        None, help="Which target layers to copy, e.g. 0,1,2,29. Default: the best candidate set by held-out KL."
    ),
    budget_minutes: Optional[float] = typer.Option(
        None,
        help="Wall-clock budget for making data and training; both stop cleanly when it runs out. Default: 45 (model), 110 (head).",
    ),
    data_share: Optional[float] = typer.Option(
        None,
        help="Part of the budget spent making new data shards; the cached ones are always used (0 = no new data, e.g. to only continue training). Default: 0.35 (model), 0.6 (head).",
    ),
    data: str = typer.Option(
        "chat+text",
        help="New training data: chat (the target's replies to template prompts), text (Python stdlib text) or chat+text (alternating shards). Cached shards are always used.",
    ),
    steps: Optional[int] = typer.Option(
        None, help="Stop training after this many steps (default: when the budget runs out)."
    ),
    seed: int = seed_option("the prompts, the data order and sampling"),
    resume: bool = typer.Option(False, help="Continue the build in the work folder from its last checkpoint."),
    work: Optional[Path] = typer.Option(
        None, help="Folder for the data cache and checkpoints. Default: OUT/.make-draft."
    ),
    share_embeddings: bool = typer.Option(
        False,
        help="Do not store the embeddings and head (the target's own): a much smaller folder that only draftverify can load, with its target.",
    ),
    save_dtype: str = typer.Option("fp32", help="Dtype of the saved weights: fp32, bf16 or fp16."),
    train_dtype: str = typer.Option(
        "auto",
        help="--kind head: the training matmuls: auto (bf16 where the CPU has bf16 instructions, else fp32), fp32 or bf16.",
    ),
    batch_tokens: Optional[int] = typer.Option(
        None, help="Tokens per training step. Default: 1024 (model), 4096 (head)."
    ),
    lr: Optional[float] = typer.Option(
        None, help="Peak learning rate (AdamW, warm-up then cosine decay). Default: 5e-4 (model), 1e-3 (head)."
    ),
    gen_batch: Optional[int] = typer.Option(
        None, help="Prompts per batched generate when making data. Default: 16 (model), 64 (head)."
    ),
    max_new_tokens: Optional[int] = typer.Option(
        None, help="Tokens the target generates per training prompt. Default: 80 (model), 96 (head)."
    ),
    heldout: Optional[int] = typer.Option(
        None,
        help="Held-out prompts (the target's greedy replies) that measure the draft's agreement. Default: 32 (model), 64 (head).",
    ),
    dtype: str = dtype_option("Target weights dtype"),
    device: str = device_option(),
):
    """Build a draft for a target. `--kind model`: its embeddings and a few of its layers, distilled on the
    target's own replies and Python stdlib text (a transformers folder with a model card). `--kind head`:
    a feature draft head trained on the target's replies to --prompts and its hidden states."""
    from draftverify.errors import require
    from draftverify.models import load_model

    require(kind in ("model", "head"), f"--kind {kind!r} is unknown: use model or head")
    require(
        kind == "model" or prompts is not None,
        "--kind head needs --prompts FILE (e.g. ../shared/data/train_prompts/prompts.jsonl)",
    )
    given = {
        "budget_minutes": budget_minutes,
        "data_share": data_share,
        "batch_tokens": batch_tokens,
        "lr": lr,
        "gen_batch": gen_batch,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    loaded = load_model(target, dtype=dtype, device=device)
    command = "draftverify make-draft " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "make-draft")
    log = lambda m: typer.echo(m, err=True)  # noqa: E731
    if kind == "head":
        from draftverify.tools.make_draft.feature_head import HeadTraining, build_head

        config = HeadTraining(
            vocab=vocab,
            epochs=epochs,
            sampled=sampled,
            templates=templates,
            train_dtype=train_dtype,
            steps=steps,
            **{k: v for k, v in given.items() if v is not None},
            **({"heldout": heldout} if heldout is not None else {}),
        )
        build_head(
            loaded,
            out,
            prompts,
            config,
            work=work,
            resume=resume,
            command=command,
            log=log,
            save_dtype=save_dtype,
            init=init,
        )
        return
    from draftverify.tools.make_draft.build import DraftConfig, build_draft

    ids = tuple(int(x) for x in layer_ids.split(",")) if layer_ids else None
    config = DraftConfig(
        layers=len(ids) if ids else layers,
        layer_ids=ids,
        steps=steps,
        data=data,
        max_shards=None,
        **{k: v for k, v in given.items() if v is not None},
        **({"heldout_prompts": heldout} if heldout is not None else {}),
    )
    build_draft(
        loaded,
        out,
        config,
        work=work,
        resume=resume,
        share_embeddings=share_embeddings,
        save_dtype=save_dtype,
        command=command,
        log=log,
    )
