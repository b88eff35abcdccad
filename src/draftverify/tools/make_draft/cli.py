"""`draftverify make-draft`: build a small draft model for a target by distillation."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer


def make_draft(
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the draft into (a transformers model folder)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target model: a local HF folder or a .gguf file. Default: SmolLM2-135M-Instruct."),
    layers: int = typer.Option(4, help="Decoder layers of the draft (copied from the target's, then trained)."),
    layer_ids: Optional[str] = typer.Option(None, help="Which target layers to copy, e.g. 0,1,2,29. Default: the best candidate set by held-out KL."),
    budget_minutes: float = typer.Option(45.0, help="Wall-clock budget for making data and training; both stop cleanly when it runs out."),
    data_share: float = typer.Option(0.35, help="Part of the budget spent making new data shards; the cached ones are always used (0 = no new data, e.g. to only continue training)."),
    data: str = typer.Option("chat+text", help="New training data: chat (the target's replies to template prompts), text (Python stdlib text) or chat+text (alternating shards). Cached shards are always used."),
    steps: Optional[int] = typer.Option(None, help="Stop training after this many steps (default: when the budget runs out)."),
    seed: int = typer.Option(0, help="Random seed (prompts, data order, sampling)."),
    resume: bool = typer.Option(False, help="Continue the build in the work folder from its last checkpoint."),
    work: Optional[Path] = typer.Option(None, help="Folder for the data cache and checkpoints. Default: OUT/.make-draft."),
    share_embeddings: bool = typer.Option(False, help="Do not store the embeddings and head (the target's own): a much smaller folder that only draftverify can load, with its target."),
    save_dtype: str = typer.Option("fp32", help="Dtype of the saved weights: fp32, bf16 or fp16."),
    batch_tokens: int = typer.Option(1024, help="Tokens per training step."),
    lr: float = typer.Option(5e-4, help="Peak learning rate (AdamW, warm-up then cosine decay)."),
    gen_batch: int = typer.Option(16, help="Prompts per batched generate when making data (raise it on a GPU)."),
    max_new_tokens: int = typer.Option(80, help="Tokens the target generates per training prompt."),
    heldout: int = typer.Option(32, help="Held-out prompts (the target's greedy replies) that measure the draft's agreement."),
    dtype: str = typer.Option("auto", help="Target weights dtype: auto (fp32 on CPU, bf16 on CUDA), fp32, bf16 or fp16."),
    device: str = typer.Option("auto", help="Device: auto (CUDA when available), cpu, cuda or cuda:N."),
):
    """Build a small, fast draft for a target: its embeddings and a few of its layers, distilled on the
    target's own replies and Python stdlib text. Writes a transformers folder with a model card."""
    from draftverify.tools.make_draft.build import DraftConfig, build_draft
    from draftverify.models import load_model

    ids = tuple(int(x) for x in layer_ids.split(",")) if layer_ids else None
    config = DraftConfig(
        layers=len(ids) if ids else layers, layer_ids=ids, budget_minutes=budget_minutes, data_share=data_share,
        steps=steps, data=data, seed=seed, batch_tokens=batch_tokens, lr=lr, gen_batch=gen_batch, max_new_tokens=max_new_tokens,
        heldout_prompts=heldout,
    )
    loaded = load_model(target, dtype=dtype, device=device)
    command = "draftverify make-draft " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "make-draft")
    build_draft(loaded, out, config, work=work, resume=resume, share_embeddings=share_embeddings, save_dtype=save_dtype,
                command=command, log=lambda m: typer.echo(m, err=True))
