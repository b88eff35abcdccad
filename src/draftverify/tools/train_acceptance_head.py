"""Training the SpecDec++ acceptance head (`draftverify train-acceptance-head`); not the EAGLE-style feature head.

Huang et al. 2024, section 3.3. Steps (data: `acceptance_data`; fit and report: `acceptance_fit`):
1. the target answers the training prompts: X_1..X_N (batched `generate`, cached on disk);
2. on the target's prefix X_<i, the target gives p_i and the draft q_i; Y_i ~ q_i and its label is
   the chance it would be accepted, P_i = min(1, p_i(Y_i) / q_i(Y_i)) (with greedy settings p and
   q are one-hot, so P_i = 1 exactly when the draft's argmax is the target's);
3. the draft reads a mixed response Z: Z_i = X_i for a fraction r of positions, Y_i for the rest
   (the paper's BERT-style mixing, so the draft sees its own tokens as at inference); its final
   hidden state e_i at each position reading a Y_i is one training input, with label P_i;
   A feature head as the draft (`--draft` a head folder, SpecDec++ over the head): instead of 2-3 the head drafts
   a chain from every root of the answers, and the predicted feature that produced each draft is labelled
   (`acceptance_data.label_head_chains`);
4. f_theta is fitted by weighted binary cross-entropy (w_acc on the accept side, w_rej on the
   reject side) and judged on held-out responses: loss and calibration (reliability bins, ECE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import (
    device_option,
    draft_option,
    dtype_option,
    prompts_option,
    seed_option,
    target_option,
)
from draftverify.drafters.acceptance_head import AcceptanceHead, save_head
from draftverify.errors import require
from draftverify.feature_head import FeatureHead
from draftverify.loading import Loaded
from draftverify.prompt_files import read_prompts
from draftverify.sampling import Sampling
from draftverify.tools.acceptance_data import labelled_examples, target_answers
from draftverify.tools.acceptance_fit import TrainSettings, fit_head, report_markdown
from draftverify.util import cache_root

SHIPPED_PROMPTS = Path(__file__).parent.parent / "assets" / "specdec-prompts.jsonl"


# -- the whole pipeline ---------------------------------------------------------------------


def train_acceptance_head(
    target: Loaded,
    draft: Loaded | FeatureHead,
    prompts: list[tuple[str, bool]],
    settings: TrainSettings,
    sampling: Sampling = Sampling(),
    max_new_tokens: int = 96,
    answer_batch: int = 48,
    cache_dir: Path | None = None,
    progress: bool = True,
    answered: tuple[list[list[int]], list[list[int]]] | None = None,
    runner=None,
) -> AcceptanceHead:
    """Steps 1-4; returns the head with `settings` (training settings and report) filled in. `answered`: step 1's
    (prompt ids, answers) when made already (`build-drafts` answers the prompts batch by batch until its deadline);
    `runner`: the target runner that labels a feature head's chains (`acceptance_data.labelled_examples`)."""
    ids, answers = answered or target_answers(
        target, prompts, sampling, max_new_tokens, answer_batch, cache_dir, progress
    )
    examples = labelled_examples(
        target, draft, ids, answers, sampling, settings.r, settings.seed, cache_dir, progress, runner=runner
    )
    head, report = fit_head(examples, settings, progress=progress)
    head.settings = {
        "drafter": "feature head" if isinstance(draft, FeatureHead) else "model",
        "training": dict(vars(settings)),
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "answer_tokens": sum(len(a) for a in answers),
        "report": report,
    }
    return head


# -- the command ---------------------------------------------------------------------------


# -- the options of `train_acceptance_head_command` -------------------------------

OUT = typer.Option(
    ...,
    "--out",
    "-o",
    help="Where to write the head (.safetensors); a training report (.md) is written next to it.",
)
CHAT = typer.Option(True, help="Wrap prompts in the chat template unless their JSONL row says otherwise.")
DEPTH = typer.Option(1, "--depth", "-D", help="D: residual SiLU blocks before the output layer (0 = a linear head).")
R = typer.Option(
    0.15,
    "--mix",
    "-r",
    help="r: fraction of response positions that keep the target's token; the rest hold draft samples and carry the "
    "loss.",
)
W_ACC = typer.Option(1.0, help="Loss weight of the accept side of the binary cross-entropy.")
W_REJ = typer.Option(
    6.0, help="Loss weight of the reject side (the paper tries 1, 3, 6, 12; larger stops drafting earlier)."
)
EPOCHS = typer.Option(
    7,
    help="Passes over the training positions (more can over-fit: watch the held-out column of the report).",
)
LR = typer.Option(1e-3, help="AdamW learning rate.")
BATCH_SIZE = typer.Option(256, help="Training positions per optimiser step.")
HOLDOUT = typer.Option(0.1, help="Fraction of responses held out for the loss and calibration report.")
MAX_NEW_TOKENS = typer.Option(96, "--max-new-tokens", "-n", help="Length cap of the target's answers.")
TEMPERATURE = typer.Option(
    0.0,
    help="Sampling settings the head is for: 0 = greedy labels (argmax match); > 0 labels min(1, p/q) at this "
    "temperature.",
)
TOP_K = typer.Option(0, help="Top-k of the sampling settings the head is for (0 = off).")
TOP_P = typer.Option(1.0, help="Top-p of the sampling settings the head is for (1 = off).")
ANSWER_BATCH = typer.Option(
    48, help="Prompts per batched `generate` call while the target answers (larger is faster per token on CPU)."
)
CACHE = typer.Option(
    True, help="Cache the target's answers and the labelled positions under ~/.cache/draftverify/specdec."
)


def train_acceptance_head_command(
    out: Path = OUT,
    target: Optional[str] = target_option(),
    draft: Optional[str] = draft_option("Draft model or feature head the head is for"),
    prompts: Path = prompts_option(SHIPPED_PROMPTS, "Training prompts"),
    chat: bool = CHAT,
    depth: int = DEPTH,
    r: float = R,
    w_acc: float = W_ACC,
    w_rej: float = W_REJ,
    epochs: int = EPOCHS,
    lr: float = LR,
    batch_size: int = BATCH_SIZE,
    holdout: float = HOLDOUT,
    seed: int = seed_option("the draft samples, the mixing, the split and the initial weights"),
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    answer_batch: int = ANSWER_BATCH,
    cache: bool = CACHE,
    dtype: str = dtype_option(),
    device: str = device_option(),
):
    """Train a SpecDec++ acceptance head for a draft/target pair (use it with `-m specdec-pp -o head=PATH`)."""
    from draftverify.loading import load_draft, load_model

    require(out.suffix == ".safetensors", f"--out {out} must end in .safetensors")
    settings = TrainSettings(depth, r, w_acc, w_rej, epochs, lr, batch_size, holdout, seed)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    rows = read_prompts(prompts, chat)
    target_model = load_model(target, dtype=dtype, device=device, direct=False)
    draft_model = load_draft(draft, target_model, dtype=dtype, device=device)
    require(
        draft_model is not None,
        "train-acceptance-head needs a draft: pass --draft (a draft model's folder, a .gguf file, self:layers=N or "
        "a feature head's folder)",
    )
    cache_dir = cache_root() / "specdec" if cache else None
    head = train_acceptance_head(
        target_model, draft_model, rows, settings, sampling, max_new_tokens, answer_batch, cache_dir
    )
    save_head(out, head, draft_model.identity, target_model.identity)
    report = report_markdown(head, out)
    out.with_suffix(".md").write_text(report)
    typer.echo(report)
    typer.echo(f"wrote {out} ({out.stat().st_size // 1024} KB) and {out.with_suffix('.md')}")
