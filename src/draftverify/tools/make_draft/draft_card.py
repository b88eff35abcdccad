"""The model card (README.md) written into a distilled draft model's folder: how it was made, from what data
under which licenses, its size, agreement and forward cost. Every number comes from the build's facts."""

from __future__ import annotations

from draftverify.tools.make_draft.data import MAX_FILE_PROMPT_TOKENS
from draftverify.tools.make_draft.prompts import TEXT_LICENSE


def model_card(f: dict) -> str:
    """README.md of the draft folder; every number comes from `facts`."""
    h = f["heldout"]
    c = f["relative_forward_cost"]
    data_rows, choice, history, load = _parts(f)
    started = (
        f"\n- Started from the draft in `{f['init']}` (its layers and weights; the layer choice below is that build's)."
        if f.get("init")
        else ""
    )
    arithmetic = " (matmuls in bf16)" if f.get("bf16") else ""
    return f"""# Draft model for {f["target"]}

A small causal LM that proposes tokens for lossless draft-then-verify decoding of
**{f["target"]}** with draftverify (speculative decoding,
Ouroboros, SpecDec++...). It shares the target's tokenizer. Made by `draftverify make-draft`;
every number below was written by that tool.

{load}

## How it was made
- Architecture: the target's ({f["target_identity"]["model_type"]}) with {len(f["layers"])} of its
  {f["target_identity"]["num_hidden_layers"]} decoder layers: target layers {f["layers"]}, plus its
  embeddings, final norm and head (frozen during training).
- Layer choice: candidate layer sets scored by held-out KL before training; the lowest was kept.{started}

| candidate | target layers | held-out KL | greedy agreement |
|---|---|---|---|
{choice}

- Training: distillation, loss KL(p || q) with p = the target's next-token distribution over its
  top-{f["config"]["topk"]} tokens (renormalised) and q = the draft's; AdamW, lr {f["config"]["lr"]},
  {f["steps"]} steps of about {f["config"]["batch_tokens"]} tokens, {f["train_seconds"]} s on {f["device"]}{arithmetic}.
- Command: `{f["command"]}`

## Data and licenses
| source | shards | sequences | target positions |
|---|---|---|---|
{data_rows}

{_sources(f)}
## Size
{f["parameters"]:,} parameters, {f["own_parameters"]:,} of them outside the (target's) embeddings and head; \
weights file {f["file_mb"]} MB ({f["save_dtype"]}).

## Quality and cost
- Held-out greedy agreement with the target (teacher-forced, {h["positions"]} positions of the
  target's greedy replies to {h["sequences"]} held-out prompts): **{h["agreement"]:.3f}**; held-out KL {h["kl"]:.3f}.
- During training (first {f["config"]["eval_sequences"]} held-out replies): {history}.
- Forward cost of one token against a 64-token cache: draft {c["draft_s"] * 1000:.1f} ms, target
  {c["target_s"] * 1000:.1f} ms, **{c["ratio"]:.2f}x** the target's (median of {c["reps"]}, same machine).
"""


def _sources(f: dict) -> str:
    """One bullet per kind of data the build trained on."""
    kinds = {kind.split("-")[0] for kind in f["data"]}
    bullets = []
    if "replies" in kinds:
        held, scored = f["config"]["heldout_prompts"], "bf16" if f.get("bf16") else "fp32"
        bullets.append(f"""\
- `replies-greedy` / `replies-sampled`: the target's own greedy (on later passes over the file:
  sampled, T=0.8, top-p 0.95) replies to the prompts of `{f["prompts"]}` of at most
  {MAX_FILE_PROMPT_TOKENS} tokens ({held} of them held out: the held-out set below), decoded by draftverify's
  engine in the target's arithmetic and scored by a teacher-forced forward of the target (matmuls in {scored}).
  No benchmark prompt was used. The prompts' own license applies to them; outputs of {f["target"]} are
  subject to that model's license (Apache-2.0 for SmolLM2).""")
    if "chat" in kinds:
        bullets.append(f"""\
- `chat-greedy` / `chat-sampled`: the target's own greedy (sampled, T=0.8, top-p 0.95) replies to
  chat prompts written from the project's templates (explain, write, tips, compare, questions,
  code tasks, code completion, code review, summarise, translate, math, reasoning, role play,
  extraction, documentation QA, chit-chat). No benchmark prompt was used. Outputs of
  {f["target"]} are subject to that model's license (Apache-2.0 for SmolLM2).""")
    if "text" in kinds or "chat" in kinds:
        bullets.append(f"""- `text`: conversations whose assistant turn is text of the Python standard library
  (`pydoc_data/topics.py` and stdlib function sources), under the {TEXT_LICENSE}; the same
  text fills the templates' passages, signatures and docstrings.""")
    return "\n".join(bullets) + "\n"


def _parts(f: dict) -> tuple[str, str, str, str]:
    """The card's data table rows, layer-choice rows, training history and how-to-load paragraph."""
    data_rows = "\n".join(
        f"| {kind} | {row['shards']} | {row['sequences']} | {row['positions']} |"
        for kind, row in sorted(f["data"].items())
    )
    choice = (
        "\n".join(
            f"| {name} | {v['layers']} | {v['kl']:.3f} | {v['agreement']:.3f} |"
            for name, v in f["layer_choice"].items()
        )
        or "| (given with --layer-ids) | | | |"
    )
    history = ", ".join(f"step {e['step']}: {e['agreement']:.3f}" for e in f["history"])
    load = (
        "The embedding and head weights are **not stored**: they are the target's, restored at load time by "
        "`draftverify.loading.load_draft(PATH, target)` (or `--draft PATH`), which refuses any other target."
        if f["share_embeddings"]
        else "This is a complete transformers folder: `AutoModelForCausalLM.from_pretrained(PATH)` loads it."
    )
    return data_rows, choice, history, load
