"""The q8 arithmetic's quality against fp32 on one model: the evidence behind `draftverify.arithmetic`'s default.

    draftverify quality [--target FILE.gguf | SHORT-NAME] [--text /usr/share/common-licenses/GPL-3] [--prompts 20]

(also `python -m draftverify.tools.quality`, the same options). Any quantized GGUF target:
- Perplexity of the target in fp32 and in q8 on a named text that no benchmark or training set of this project uses
  (default: the GNU GPL version 3 as Debian ships it, /usr/share/common-licenses/GPL-3), in windows of `--window`
  tokens, each token scored given the window's earlier tokens; `--text-tokens` scores only the text's first tokens.
- Greedy agreement: of N prompts, how many give the same first `--tokens` tokens (default 128) in both arithmetics.
  The prompts are the first sentences of the docstrings of Python standard-library modules (`PROMPT_MODULES`):
  a named source that is no benchmark set. They go through the chat template where the model has one.

Writes `<out>/<model>.md` (with the command that produced it) and `<out>/<model>.json` (the record), atomically
(`--out` default: runs/q8-quality).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Optional

import typer

from draftverify.arithmetic import PPL_TOLERANCE, within_tolerance
from draftverify.cli_options import target_option
from draftverify.errors import require
from draftverify.util import atomic_write, command_line

TEXT = Path("/usr/share/common-licenses/GPL-3")
PROMPT_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "csv", "difflib", "fractions", "heapq", "json",
    "logging", "pathlib", "pickle", "random", "shlex", "statistics", "string", "textwrap", "urllib.parse", "uuid",
    "zipfile", "tarfile", "sqlite3", "socket", "decimal", "dataclasses", "functools", "itertools", "gzip", "email",
)  # fmt: skip


def prompts(n: int) -> list[str]:
    """The first sentence of each of the first n `PROMPT_MODULES`' docstrings, asked about."""
    out = []
    for name in PROMPT_MODULES[:n]:
        doc = (importlib.import_module(name).__doc__ or name).strip().split("\n\n")[0].replace("\n", " ")
        out.append(f"Explain what this Python module does and give an example: {doc[:200]}")
    return out


def perplexity(engine, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of `ids` [n] in windows of `window` tokens, on the engine's target."""
    import torch

    runner, nll, count = engine.target_runner, 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        runner.reset()
        logits = runner.forward(chunk[:-1]).logits.float()  # [n, V]
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    runner.reset()
    return math.exp(nll / count)


def measure(target: Path, dtype: str, text: str, asks: list[str], window: int, tokens: int, text_tokens: int) -> dict:
    """One arithmetic's perplexity on `text` and greedy outputs of `asks`."""
    from draftverify.engine import Engine

    engine = Engine.load(str(target), draft="none", dtype=dtype)
    chat = bool(getattr(engine.target.tokenizer, "chat_template", None))
    ids = engine.target.tokenizer(text)["input_ids"]
    ids = ids[: text_tokens + 1] if text_tokens > 0 else ids
    outs = [engine.generate(p, "autoregressive", max_new_tokens=tokens, chat=chat).tokens for p in asks]
    return {
        "name": engine.target.name,
        "arithmetic": engine.arithmetic,
        "ppl": perplexity(engine, ids, window),
        "outs": outs,
        "tokens": len(ids) - 1,
    }  # fmt: skip (tokens: those scored, each after the one before)


def report(fp32: dict, q8: dict, settings: dict, command: str) -> tuple[str, dict]:
    """The report's markdown and the record: perplexities, agreement, the settings."""
    n = settings["tokens"]
    same = sum(a[:n] == b[:n] for a, b in zip(fp32["outs"], q8["outs"]))
    record = {"ppl_fp32": fp32["ppl"], "ppl_q8": q8["ppl"], "text": settings["text"], "window": settings["window"],
              "scored": fp32["tokens"], "agree": same, "prompts": len(fp32["outs"]), "tokens": n}  # fmt: skip
    ok = within_tolerance(record)
    rel = q8["ppl"] / fp32["ppl"] - 1
    md = "\n".join([
        f"# q8 against fp32: {fp32['name']}", "",
        f"Produced by `{command}`.", "",
        f"- Perplexity on `{settings['text']}` ({fp32['tokens']} tokens, windows of {settings['window']}):"
        f" fp32 {fp32['ppl']:.4f}, q8 {q8['ppl']:.4f} ({rel:+.2%}).",
        f"- Greedy agreement: {same} of {len(fp32['outs'])} prompts give the same first {n} tokens"
        " (prompts: the first sentences of Python standard-library module docstrings, `tools/quality.py`).",
        f"- q8 within {PPL_TOLERANCE:.0%} of fp32's perplexity (the bound behind q8 being the default for a"
        f" quantized GGUF target, `draftverify.arithmetic`): {'yes' if ok else 'no'}.",
        "",
    ])  # fmt: skip
    return md, record


def quality_command(
    target: Optional[str] = target_option("The model to measure (a quantized GGUF file)"),
    text: Path = typer.Option(TEXT, help="The text whose perplexity is scored."),
    n_prompts: int = typer.Option(20, "--prompts", help="How many prompts for greedy agreement."),
    tokens: int = typer.Option(128, help="Tokens generated and compared per prompt."),
    window: int = typer.Option(512, help="Tokens per perplexity window."),
    text_tokens: int = typer.Option(0, help="Score only the text's first this many tokens (0: all of it)."),
    out: Path = typer.Option(Path("runs/q8-quality"), help="The folder the report and record go to."),
):
    """Measure q8's perplexity and greedy agreement against fp32 on a quantized GGUF target; write a report."""
    from draftverify.arithmetic import quantized_layers
    from draftverify.loading.known import resolve_model

    require(text.is_file(), f"--text {text} does not exist: name a text file to score")
    require(min(n_prompts, tokens, window) >= 1 and text_tokens >= 0, "--prompts, --tokens and --window must be >= 1")
    path = resolve_model(target)
    require(
        path.suffix == ".gguf" and quantized_layers(path),
        f"{path} is not a quantized GGUF file: q8 multiplies quantized block weights, so there is nothing to compare",
    )
    body, asks = text.read_text(), prompts(n_prompts)
    fp32 = measure(path, "fp32", body, asks, window, tokens, text_tokens)
    q8 = measure(path, "q8", body, asks, window, tokens, text_tokens)
    argv = sys.argv[2:] if sys.argv[1:2] == ["quality"] else sys.argv[1:]
    settings = {"text": str(text), "window": window, "tokens": tokens}
    md, record = report(fp32, q8, settings, command_line("draftverify quality", argv))
    stem = Path(fp32["name"]).stem
    atomic_write(out / f"{stem}.md", md)
    atomic_write(out / f"{stem}.json", json.dumps(record, indent=1, sort_keys=True) + "\n")
    typer.echo(md)


if __name__ == "__main__":
    typer.run(quality_command)
