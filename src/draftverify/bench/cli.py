"""`draftverify bench`: the command line over bench.runner (heavy imports inside the command)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import (
    backend_option,
    device_option,
    draft_option,
    dtype_option,
    seed_option,
    target_option,
)
from draftverify.util import command_line

DEFAULT_METHODS = "autoregressive,speculative,hf-assisted,hf-prompt-lookup"
DEFAULT_MAX_NEW_TOKENS = 256  # replies long enough that the prompt's forward does not dominate the time

DATASETS = typer.Option(
    "spec_bench",
    help="Comma-separated prompt sets from the data folder: spec_bench, mt_bench, humaneval, gsm8k, "
    "cnn_dailymail ('' for none, with --prompts).",
)
PROMPTS = typer.Option(
    None,
    "--prompts",
    help='Your own prompts: a JSONL file, one object per line with a "prompt" string (optional "id", "category").',
)
DATA_DIR = typer.Option(
    None,
    help="The data folder (spec_bench/, humaneval/, ...). Default: $DRAFTVERIFY_DATA_DIR, "
    "else ../shared/data from the current folder or the repository.",
)
LIMIT = typer.Option(None, help="Take the first N rows of each prompt set.")
PER_CATEGORY = typer.Option(None, help="Take the first N rows of each category of each prompt set.")
TURNS = typer.Option(
    None,
    help="Multi-turn rows (MT-Bench, Spec-Bench): 'all' benchmarks turn 2 too, after the greedy autoregressive "
    "answer to turn 1; 'first' only turn 1. Default: all.",
)
METHODS = typer.Option(
    DEFAULT_METHODS,
    "--methods",
    "-m",
    help="Comma-separated method specs: name, name:preset, name\\[key=value,...] or name:preset\\[key=value]; "
    "any method of `draftverify methods`, plus the peers hf-assisted, hf-prompt-lookup, hf-autoregressive "
    "(transformers), llamacpp (llama.cpp on the target's own GGUF), llamacpp-f32 (on its F32 re-export) and "
    "llamacpp-prompt-lookup. Add warm=false to rebuild a method per prompt. "
    "autoregressive (the baseline) is added when missing.",
)
MAX_NEW_TOKENS = typer.Option(
    None,
    "--max-new-tokens",
    "-n",
    help=f"New tokens per generation (fixed; EOS may stop earlier). Default {DEFAULT_MAX_NEW_TOKENS}.",
)
REPEATS = typer.Option(
    None, help="Generations per prompt and method; the report gives the median and \\[min, max]. Default 1."
)
TEMPERATURE = typer.Option(0.0, help="0 = greedy (and the exactness check); > 0 samples.")
TOP_K = typer.Option(0, help="Sampling: keep the k most likely tokens (0 = off).")
TOP_P = typer.Option(1.0, help="Sampling: nucleus probability (1 = off).")
SEED = seed_option("sampling: each prompt and repeat gets seed + its index, all methods alike")
PROMPT_FORMAT = typer.Option(
    "auto", help="auto: each set's own format (chat template; raw completion for HumanEval); chat; raw."
)
DTYPE = dtype_option("The target's arithmetic (the report names it)")
DEVICE = device_option()
BACKEND = backend_option("Forward path of draftverify's methods")
TARGET = target_option()
DRAFT = draft_option("Draft model for the methods that need one")
OUT = typer.Option(
    Path("runs/bench"), "--out", help="Output folder; rerunning the same command there resumes an interrupted run."
)
OVERWRITE = typer.Option(False, help="Start over, discarding the records already in --out.")
QUICK = typer.Option(
    False,
    help="Smoke test: 2 rows per prompt set, first turns only, 16 new tokens, 1 repeat (explicit options still win).",
)
PROGRESS = typer.Option(True, help="Show a progress bar.")
SPEC_BENCH_JSONL = typer.Option(
    None,
    "--spec-bench-jsonl",
    help="Also write Spec-Bench's answer files into this folder, one <target>-<method>.jsonl per method, "
    "for its evaluation/speed.py and equal.py.",
)


def bench(
    datasets: str = DATASETS,
    prompts: Optional[Path] = PROMPTS,
    data_dir: Optional[Path] = DATA_DIR,
    limit: Optional[int] = LIMIT,
    per_category: Optional[int] = PER_CATEGORY,
    turns: Optional[str] = TURNS,
    methods: str = METHODS,
    max_new_tokens: Optional[int] = MAX_NEW_TOKENS,
    repeats: Optional[int] = REPEATS,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    seed: int = SEED,
    prompt_format: str = PROMPT_FORMAT,
    target: Optional[str] = TARGET,
    draft: Optional[str] = DRAFT,
    dtype: str = DTYPE,
    device: str = DEVICE,
    backend: str = BACKEND,
    out: Path = OUT,
    overwrite: bool = OVERWRITE,
    quick: bool = QUICK,
    progress: bool = PROGRESS,
    spec_bench_jsonl: Optional[Path] = SPEC_BENCH_JSONL,
):
    """Benchmark decoding methods side by side on real prompt sets: speed, exactness against
    autoregressive decoding, and the SpecDec++ oracle; writes report.md, results.json/.csv and plots to --out."""
    from draftverify.bench.runner import Bench, Settings
    from draftverify.bench.specs import parse_specs

    if quick:
        limit = limit if limit is not None or per_category is not None else 2
        turns, max_new_tokens, repeats = turns or "first", max_new_tokens or 16, repeats or 1
    specs = parse_specs(methods)
    n, repeats = max_new_tokens or DEFAULT_MAX_NEW_TOKENS, repeats or 1
    settings = Settings(n, repeats, temperature, top_k, top_p, seed, prompt_format, dtype=dtype)
    prompt_list = _prompts(datasets, data_dir, prompts, limit, per_category, turns)
    engine = _engine(specs, target, draft, dtype, device, backend)
    _describe(engine, f"{len(prompt_list)} prompts x {len(specs)} methods x {settings.repeats} repeat(s)")
    command = command_line("draftverify", sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""  # empty from Python
    results = Bench(engine, prompt_list, specs, settings, out).run(
        command=command, overwrite=overwrite, progress=progress
    )
    _finish(results, out, spec_bench_jsonl, engine)


def _finish(results: dict, out: Path, spec_bench_jsonl: Path | None, engine) -> None:
    """The Spec-Bench answer files when asked for, and the headline on the terminal."""
    if spec_bench_jsonl is not None:
        _spec_bench(results, spec_bench_jsonl, engine)
    report = (out / "report.md").read_text()
    headline = report.split("## Headline (all prompts)", 1)[1].split("\n## ", 1)[0]
    typer.echo("Headline (all prompts):" + headline.rstrip())
    typer.echo(f"\nreport: {out / 'report.md'}")


def _prompts(datasets: str, data_dir, prompts, limit, per_category, turns) -> list:
    from draftverify.bench.datasets import load_prompts, resolve_data_dir

    names = [d.strip() for d in datasets.split(",") if d.strip()]
    folder = resolve_data_dir(data_dir) if names else None
    return load_prompts(names, folder, prompts, limit=limit, per_category=per_category, turns=turns or "all")


def _engine(specs, target, draft, dtype: str, device: str, backend: str):
    """The engine the run decodes with (the default drafts only when a method may use them)."""
    from draftverify.bench import llamacpp
    from draftverify.engine import Engine

    if not llamacpp.available() and not any(s.engine == "llama.cpp" for s in specs):
        typer.echo(f"note: {llamacpp.INSTALL_HINT} (then add llamacpp,llamacpp-f32 to --methods)", err=True)
    drafts = draft if any(s.drafts.loads for s in specs) else "none"
    return Engine.load(target, drafts, dtype=dtype, device=device, backend=backend)


def _describe(engine, run: str) -> None:
    """What runs, on the terminal: the models, the forward path and the size of the run."""
    what = f"target {engine.target.name}, {engine.describe_drafts()}, backend {engine.describe_backend()}"
    typer.echo(f"{what}; {run}", err=True)


def _spec_bench(results: dict, folder: Path, engine) -> None:
    from draftverify.bench.specbench import write_answers

    tokenizer = engine.target.tokenizer
    paths = write_answers(results, folder, lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True))
    typer.echo(f"Spec-Bench answer files: {', '.join(str(p) for p in paths.values())}", err=True)
