"""`draftverify bench`: the command line over bench.runner (heavy imports inside the command)."""

from __future__ import annotations

import shlex
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

DEFAULT_METHODS = "autoregressive,speculative,hf-assisted,hf-prompt-lookup"


def bench(
    datasets: str = typer.Option(
        "spec_bench",
        help="Comma-separated prompt sets from the data folder: spec_bench, mt_bench, humaneval, gsm8k, "
        "cnn_dailymail ('' for none, with --prompts).",
    ),
    prompts: Optional[Path] = typer.Option(
        None,
        "--prompts",
        help='Your own prompts: a JSONL file, one object per line with a "prompt" string (optional "id", "category").',
    ),
    data_dir: Optional[Path] = typer.Option(
        None,
        help="The data folder (spec_bench/, humaneval/, ...). Default: $DRAFTVERIFY_DATA_DIR, else ../shared/data from the current folder or the repository.",
    ),
    limit: Optional[int] = typer.Option(None, help="Take the first N rows of each prompt set."),
    per_category: Optional[int] = typer.Option(None, help="Take the first N rows of each category of each prompt set."),
    turns: Optional[str] = typer.Option(
        None,
        help="Multi-turn rows (MT-Bench, Spec-Bench): 'all' benchmarks turn 2 too, after the greedy autoregressive answer to turn 1; 'first' only turn 1. Default: all.",
    ),
    methods: str = typer.Option(
        DEFAULT_METHODS,
        "--methods",
        "-m",
        help="Comma-separated method specs: name, name:preset, name\\[key=value,...] or name:preset\\[key=value]; any method of "
        "`draftverify methods`, plus hf-assisted and hf-prompt-lookup (transformers). Add warm=false to rebuild a method per prompt. "
        "autoregressive (the baseline) is added when missing.",
    ),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", "-n", help="New tokens per generation (fixed; EOS may stop earlier). Default 128."
    ),
    repeats: Optional[int] = typer.Option(
        None, help="Generations per prompt and method; the report gives the median and \\[min, max]. Default 1."
    ),
    temperature: float = typer.Option(0.0, help="0 = greedy (and the exactness check); > 0 samples."),
    top_k: int = typer.Option(0, help="Sampling: keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, help="Sampling: nucleus probability (1 = off)."),
    seed: int = seed_option("sampling: each prompt and repeat gets seed + its index, all methods alike"),
    prompt_format: str = typer.Option(
        "auto", help="auto: each set's own format (chat template; raw completion for HumanEval); chat; raw."
    ),
    target: Optional[str] = target_option(),
    draft: Optional[str] = draft_option("Draft model for the methods that need one"),
    dtype: str = dtype_option(),
    device: str = device_option(),
    backend: str = backend_option("Forward path of draftverify's methods"),
    out: Path = typer.Option(
        Path("runs/bench"), "--out", help="Output folder; rerunning the same command there resumes an interrupted run."
    ),
    overwrite: bool = typer.Option(False, help="Start over, discarding the records already in --out."),
    quick: bool = typer.Option(
        False,
        help="Smoke test: 2 rows per prompt set, first turns only, 16 new tokens, 1 repeat (explicit options still win).",
    ),
    progress: bool = typer.Option(True, help="Show a progress bar."),
):
    """Benchmark decoding methods side by side on real prompt sets: speed, exactness against
    autoregressive decoding, and the SpecDec++ oracle; writes report.md, results.json/.csv and plots to --out."""
    from draftverify.bench.datasets import load_prompts, resolve_data_dir
    from draftverify.bench.runner import Bench, Settings
    from draftverify.bench.specs import parse_specs
    from draftverify.engine import Engine

    if quick:
        limit = limit if limit is not None or per_category is not None else 2
        turns, max_new_tokens, repeats = turns or "first", max_new_tokens or 16, repeats or 1
    names = [d.strip() for d in datasets.split(",") if d.strip()]
    specs = parse_specs(methods)
    settings = Settings(
        max_new_tokens=max_new_tokens or 128,
        repeats=repeats or 1,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        prompt_format=prompt_format,
    )
    prompt_list = load_prompts(
        names,
        resolve_data_dir(data_dir) if names else None,
        prompts,
        limit=limit,
        per_category=per_category,
        turns=turns or "all",
    )
    from draftverify.bench import llamacpp

    if not llamacpp.available() and not any(s.engine == "llama.cpp" for s in specs):
        typer.echo(f"note: {llamacpp.INSTALL_HINT} (then add llamacpp,llamacpp-prompt-lookup to --methods)", err=True)
    engine = Engine.load(
        target, draft if any(s.loads_draft for s in specs) else "none", dtype=dtype, device=device, backend=backend
    )
    typer.echo(
        f"target {engine.target.name}, {engine.describe_drafts()}, backend {engine.describe_backend()}; {len(prompt_list)} prompts x {len(specs)} methods x {settings.repeats} repeat(s)",
        err=True,
    )
    command = (
        "draftverify " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""
    )  # empty when not run from a shell
    Bench(engine, prompt_list, specs, settings, out).run(command=command, overwrite=overwrite, progress=progress)
    report = (out / "report.md").read_text()
    headline = report.split("## Headline (all prompts)", 1)[1].split("\n## ", 1)[0]
    typer.echo("Headline (all prompts):" + headline.rstrip())
    typer.echo(f"\nreport: {out / 'report.md'}")
