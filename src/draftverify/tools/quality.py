"""The q8 arithmetic's quality against fp32 on one model: the evidence behind `draftverify.arithmetic`'s default.

    python -m draftverify.tools.quality [--target FILE.gguf] [--text /usr/share/common-licenses/GPL-3] [--prompts 20]

- Perplexity of the target in fp32 and in q8 on a named text that no benchmark or training set of this project uses
  (default: the GNU GPL version 3 as Debian ships it, /usr/share/common-licenses/GPL-3), in windows of `--window`
  tokens, each token scored given the window's earlier tokens.
- Greedy agreement: of N prompts, how many give the same first `--tokens` tokens (default 128) in both arithmetics.
  The prompts are the first sentences of the docstrings of Python standard-library modules (`PROMPT_MODULES`):
  a named source that is no benchmark set.

Writes runs/q8-quality/<model>.md (`--out` names another folder; with the command that produced it) and the model's
record in src/draftverify/assets/q8_quality.json, which the default rule reads; both atomically.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shlex
import sys
from pathlib import Path

import torch

from draftverify.arithmetic import PPL_TOLERANCE, QUALITY, within_tolerance
from draftverify.util import atomic_write

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


def measure(target: str | None, dtype: str, text: str, asks: list[str], window: int, tokens: int) -> dict:
    from draftverify.engine import Engine

    engine = Engine.load(target, draft="none", dtype=dtype)
    ids = engine.target.tokenizer(text)["input_ids"]
    outs = [engine.generate(p, "autoregressive", max_new_tokens=tokens, chat=True).tokens for p in asks]
    return {"name": engine.target.name, "arithmetic": engine.arithmetic, "ppl": perplexity(engine, ids, window),
            "outs": outs, "tokens": len(ids)}  # fmt: skip


def report(fp32: dict, q8: dict, args, command: str) -> tuple[str, dict]:
    same = sum(a[: args.tokens] == b[: args.tokens] for a, b in zip(fp32["outs"], q8["outs"]))
    record = {"ppl_fp32": fp32["ppl"], "ppl_q8": q8["ppl"], "text": str(args.text), "window": args.window,
              "agree": same, "prompts": len(fp32["outs"]), "tokens": args.tokens}  # fmt: skip
    ok = within_tolerance(record)
    rel = q8["ppl"] / fp32["ppl"] - 1
    md = "\n".join([
        f"# q8 against fp32: {fp32['name']}", "",
        f"Produced by `{command}`.", "",
        f"- Perplexity on `{args.text}` ({fp32['tokens']} tokens, windows of {args.window}): fp32 {fp32['ppl']:.4f},"
        f" q8 {q8['ppl']:.4f} ({rel:+.2%}).",
        f"- Greedy agreement: {same} of {len(fp32['outs'])} prompts give the same first {args.tokens} tokens"
        " (prompts: the first sentences of Python standard-library module docstrings, `tools/quality.py`).",
        f"- The default rule (q8 within {PPL_TOLERANCE:.0%} of fp32's perplexity, `draftverify.arithmetic`):"
        f" {'met: q8 is the default for this file on CPUs with VNNI' if ok else 'not met: fp32 stays the default'}.",
        "",
    ])  # fmt: skip
    return md, record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftverify.tools.quality", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--text", type=Path, default=TEXT, help="the text to score (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=20, help="how many prompts for greedy agreement")
    parser.add_argument("--tokens", type=int, default=128, help="tokens compared per prompt")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--out", type=Path, default=Path("runs/q8-quality"), help="report folder (%(default)s)")
    args = parser.parse_args(argv)
    if not args.text.is_file():
        parser.error(f"--text {args.text} does not exist: name a text file to score")
    text, asks = args.text.read_text(), prompts(args.prompts)
    fp32 = measure(args.target, "fp32", text, asks, args.window, args.tokens)
    q8 = measure(args.target, "q8", text, asks, args.window, args.tokens)
    command = "python -m draftverify.tools.quality " + shlex.join(argv if argv is not None else sys.argv[1:])
    md, record = report(fp32, q8, args, command.strip())
    atomic_write(args.out / f"{Path(fp32['name']).stem}.md", md)
    records = json.loads(QUALITY.read_text()) if QUALITY.is_file() else {}
    records[fp32["name"]] = record
    atomic_write(QUALITY, json.dumps(records, indent=1, sort_keys=True) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
