"""The command line of `draftverify load` (the load generator itself is `draftverify.serve.load`): its options,
the prompts from the shared prompt sets, and the run, spawned or against a server on loopback."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import draft_option, target_option
from draftverify.errors import require
from draftverify.serve.load import Ask, check_loopback, load, spawned_server
from draftverify.serve.load_format import read_response_format
from draftverify.serve.load_report import report, write


def load_prompt_texts(datasets: list[str], data_dir: str | None, count: int) -> list[str]:
    """`count` first-turn prompts, taken in turn from each named shared prompt set (so every run mixes them)."""
    from draftverify.bench.datasets import load_prompts, resolve_data_dir

    per_set = [load_prompts([name], resolve_data_dir(data_dir), limit=count, turns="first") for name in datasets]
    mixed = [p.turns[0] for group in zip(*per_set) for p in group] if per_set else []
    require(mixed, f"no prompts in {', '.join(datasets)}: check --datasets and --data-dir")
    return mixed[:count]


def parse_levels(concurrency: str) -> list[int]:
    """--concurrency "1,4,8" as [1, 4, 8]; anything but positive whole numbers is refused."""
    levels = (
        [int(x) for x in concurrency.split(",") if x.strip()]
        if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", concurrency)
        else []
    )
    require(
        levels and all(c >= 1 for c in levels),
        f"--concurrency {concurrency!r}: give positive whole numbers, e.g. 1,4,8",
    )
    return levels


# -- the options of `load` --------------------------------------------------------

LOAD_URL = typer.Option(None, help="The server's base URL on this machine, e.g. http://127.0.0.1:8000/v1 (or --spawn).")
LOAD_SPAWN = typer.Option(
    False, help="Start `draftverify serve` with --methods on a free loopback port, and stop it after."
)
LOAD_METHODS = typer.Option(
    "autoregressive,auto",
    help="Methods to load, comma-separated method specs; each request names one (the server must have it).",
)
LOAD_CONCURRENCY = typer.Option("1,8", help="Concurrent clients per run, comma-separated, e.g. 1,4,8.")
LOAD_REQUESTS = typer.Option(24, help="Requests per run (method x concurrency).")
LOAD_MAX_TOKENS = typer.Option(64, help="New tokens per request at most.")
LOAD_DATASETS = typer.Option(
    "mt_bench,humaneval,gsm8k,cnn_dailymail",
    help="Shared prompt sets the prompts come from (first turns, taken in turn).",
)
LOAD_DATA_DIR = typer.Option(None, help="The folder holding the prompt sets (default: ../shared/data).")
LOAD_TIMEOUT = typer.Option(300.0, help="Seconds one request may take before it counts as an error.")
LOAD_TIME_LIMIT = typer.Option(1800.0, help="No request starts after this many seconds of the whole load run.")
LOAD_RESPONSE_FORMAT = typer.Option(
    None,
    help='A JSON file holding an OpenAI response_format object (e.g. {"type": "json_schema", "json_schema": '
    '{"name": ..., "schema": {...}}}) that every request carries; JSON outputs are checked (column invalid).',
)
LOAD_SYSTEM = typer.Option(None, help="A system message sent before every prompt, e.g. what to answer in JSON.")
LOAD_OUT = typer.Option(Path("load-results"), help="Folder for results.json, report.md and tokens_per_s.png.")


def load_command(
    url: Optional[str] = LOAD_URL,
    spawn: bool = LOAD_SPAWN,
    target: Optional[str] = target_option("--spawn: the target model"),
    draft: Optional[str] = draft_option("--spawn: the draft model"),
    methods: str = LOAD_METHODS,
    concurrency: str = LOAD_CONCURRENCY,
    requests: int = LOAD_REQUESTS,
    max_tokens: int = LOAD_MAX_TOKENS,
    datasets: str = LOAD_DATASETS,
    data_dir: Optional[str] = LOAD_DATA_DIR,
    timeout: float = LOAD_TIMEOUT,
    time_limit: float = LOAD_TIME_LIMIT,
    response_format: Optional[Path] = LOAD_RESPONSE_FORMAT,
    system: Optional[str] = LOAD_SYSTEM,
    out: Path = LOAD_OUT,
):
    """Load-test the OpenAI-compatible endpoint: tokens/s, latency and TTFT per method and concurrency, and whether
    greedy outputs under load equal the single-client ones. Loopback only; bounded in requests and time."""
    from draftverify.methods.spec import parse_specs, split_specs
    from draftverify.util import command_line

    require(spawn != (url is not None), "give either --url (a running server on this machine) or --spawn")
    require(requests >= 1 and max_tokens >= 1, "--requests and --max-tokens must be at least 1")
    levels = parse_levels(concurrency)
    fmt = read_response_format(response_format) if response_format is not None else None
    labels = [s.label for s in parse_specs(methods)] if spawn else split_specs(methods)
    prompts = load_prompt_texts([d for d in datasets.split(",") if d], data_dir, requests)
    command = command_line("draftverify", sys.argv[1:]) if sys.argv[1:2] == ["load"] else ""
    ask = Ask(max_tokens, timeout, fmt, system)
    settings = (labels, levels, prompts, requests, ask, time_limit)
    fmt_file = None if response_format is None else str(response_format)

    def go(base: str, server: str) -> dict:
        return load(base, *settings, server, command, datasets, fmt_file, log=lambda m: typer.echo(m, err=True))

    if spawn:
        typer.echo("starting draftverify serve on loopback (loading the model)...", err=True)
        with spawned_server(methods, target, draft, out / "server.log") as base:
            results = go(base, f"spawned: draftverify serve --methods {methods}")
    else:
        results = go(check_loopback(url), url)
    write(out, results)
    typer.echo(report(results).split("\n\n![", 1)[0])
    typer.echo(f"\nreport: {out / 'report.md'}")
