"""The `draftverify` command line (typer).

Commands live next to the code they drive and are registered at the bottom of this file;
heavy imports happen inside the commands so that `--help` stays fast.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import backend_option, device_option, draft_option, dtype_option, target_option
from draftverify.errors import DraftVerifyError, require

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

app = typer.Typer(
    help="Lossless draft-then-verify decoding for local causal LMs: same output as the target alone, faster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _quiet(
    verbose: bool = typer.Option(
        False, "--verbose", help="Show transformers' own progress bars and warnings (hidden by default)."
    ),
):
    """Lossless draft-then-verify decoding for local causal LMs: same output as the target alone, faster."""
    if not verbose:  # our own progress and notices stay; third-party loading bars and warnings go
        quiet_transformers()


def quiet_transformers() -> None:
    """transformers' and the hub's progress bars off and transformers' log at errors, without importing either (a
    GGUF target loads without them): set where already imported, else through the environment they read at import
    (`HF_HUB_DISABLE_PROGRESS_BARS`, `TRANSFORMERS_VERBOSITY`)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def _load_engine(target, draft, dtype, device, draft_device=None, device_map=None, backend="auto"):
    from draftverify.engine import Engine

    engine = Engine.load(
        target, draft, dtype=dtype, device=device, draft_device=draft_device, device_map=device_map, backend=backend
    )
    draft = engine.draft_runner if engine.draft_loaded else None
    if any(r is not None and r.fallback_reason for r in (engine.target_runner, draft)):
        typer.echo(f"backend: {engine.describe_backend()}", err=True)
    return engine


# -- the options of `generate` ----------------------------------------------------

GENERATE_PROMPT = typer.Argument(None, help="The prompt text (or use --prompt-file).")
GENERATE_PROMPT_FILE = typer.Option(None, help="Read the prompt from this file ('-' for stdin).")
GENERATE_METHOD = typer.Option(
    "auto",
    "--method",
    "-m",
    help="Decoding method (see `draftverify methods`), as a method spec: name, name:preset or name\\[key=value,...], "
    "e.g. speculative:k2.",
)
GENERATE_PRESET = typer.Option(None, help="A named parameter preset of the method (see `draftverify methods`).")
GENERATE_OPTION = typer.Option(
    [],
    "--option",
    "-o",
    help="A method option as key=value, e.g. -o k=4 -o policy=heuristic, -o pool_file=pools/code.json (lookahead, "
    "ouroboros), -o skip_file=skip.json (self-speculative). Repeatable.",
)
GENERATE_CHAT = typer.Option(
    True, help="Wrap the prompt in the model's chat template as one user turn (--no-chat for raw completion)."
)
GENERATE_MAX_NEW_TOKENS = typer.Option(128, "--max-new-tokens", "-n", help="Stop after this many new tokens.")
GENERATE_TEMPERATURE = typer.Option(0.0, help="0 = greedy; > 0 samples (exactly the target's distribution).")
GENERATE_TOP_K = typer.Option(0, help="Keep only the k most likely tokens when sampling (0 = off).")
GENERATE_TOP_P = typer.Option(
    1.0, help="Nucleus sampling: keep the smallest set of tokens with this much probability (1 = off)."
)
GENERATE_SEED = typer.Option(None, help="Random seed for sampling (reproducible runs).")
GENERATE_STOP = typer.Option(
    [], help="Stop when the output contains this text (repeatable); the text is cut before it."
)
GENERATE_JSON_SCHEMA = typer.Option(
    None, "--json-schema", help="A JSON schema file: the output is JSON that validates against it (exactly)."
)
GENERATE_STREAM = typer.Option(False, help="Print tokens as they are accepted.")
GENERATE_AS_JSON = typer.Option(False, "--json", help="Print one JSON object: text, tokens and stats.")
GENERATE_EXPLAIN = typer.Option(False, help="auto: also print which drafter produced each round's tokens.")


@app.command()
def generate(
    prompt: Optional[str] = GENERATE_PROMPT,
    prompt_file: Optional[Path] = GENERATE_PROMPT_FILE,
    target: Optional[str] = target_option(),
    draft: Optional[str] = draft_option(),
    method: str = GENERATE_METHOD,
    preset: Optional[str] = GENERATE_PRESET,
    option: list[str] = GENERATE_OPTION,
    chat: bool = GENERATE_CHAT,
    max_new_tokens: int = GENERATE_MAX_NEW_TOKENS,
    temperature: float = GENERATE_TEMPERATURE,
    top_k: int = GENERATE_TOP_K,
    top_p: float = GENERATE_TOP_P,
    seed: Optional[int] = GENERATE_SEED,
    stop: list[str] = GENERATE_STOP,
    json_schema: Optional[Path] = GENERATE_JSON_SCHEMA,
    dtype: str = dtype_option(),
    device: str = device_option(),
    backend: str = backend_option(),
    stream: bool = GENERATE_STREAM,
    as_json: bool = GENERATE_AS_JSON,
    explain: bool = GENERATE_EXPLAIN,
):
    """Generate text with a draft-then-verify method and print it with its stats."""
    if prompt_file is not None:
        prompt = sys.stdin.read() if str(prompt_file) == "-" else prompt_file.read_text()
    if prompt is None:
        raise DraftVerifyError("no prompt: pass PROMPT or --prompt-file FILE")
    from draftverify.methods.spec import drafts_of

    spec, options = _method_options(method, preset, option)
    loads = drafts_of(spec.name, spec.preset or preset, options).loads
    engine = _load_engine(target, draft if loads else "none", dtype, device, backend=backend)
    if json_schema is not None:
        from draftverify.constraints import load_schema_file

        schema = {"name": json_schema.stem, "schema": load_schema_file(str(json_schema))}
        options["response_format"] = {"type": "json_schema", "json_schema": schema}
    streamer = None
    if stream and not as_json:
        from transformers import TextStreamer

        streamer = TextStreamer(engine.target.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = engine.generate(
        prompt,
        method=spec.name,
        preset=spec.preset or preset,
        chat=chat,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=stop or None,
        streamer=streamer,
        **options,
    )
    _print_result(result, engine.target.tokenizer, as_json, streamed=streamer is not None, explain=explain)


def _method_options(method: str, preset: str | None, option: list[str]):
    """The --method spec and its options, the -o flags added (an option or a preset given twice is refused)."""
    from draftverify.methods.spec import parse_options, parse_spec

    spec = parse_spec(method)
    require(
        preset is None or spec.preset is None, f"--method {method} names a preset and so does --preset: give it once"
    )
    options = dict(spec.options)
    for key, value in parse_options(option).items():
        require(key not in options, f"option {key} is given in --method {method} and again as a flag: give it once")
        options[key] = value
    return spec, options


def _print_result(result, tokenizer, as_json: bool, streamed: bool, explain: bool) -> None:
    """The text (unless it was streamed) on stdout and the stats on stderr, or one JSON object on stdout."""
    if as_json:
        stats = result.stats.to_dict(timings=False)
        typer.echo(json.dumps({"text": result.text, "tokens": result.tokens, "stats": stats}))
        return
    if not streamed:
        typer.echo(result.text)
    if explain:
        typer.echo("\n" + explain_rounds(result, tokenizer), err=True)
    typer.echo("\n" + result.stats.summary(), err=True)


def explain_rounds(result, tokenizer) -> str:
    """Who drafted each round of an `auto` generation (its `auto_chunks`), with the text it produced."""
    chunks = result.stats.extra.get("auto_chunks")
    require(chunks is not None, "--explain needs method auto: it says which drafter produced each chunk")
    lines, start = [f"{'prefill':>14}  {tokenizer.decode(result.tokens[:1])!r}"], 1
    for who, n in chunks:
        if start >= len(result.tokens):
            break
        lines.append(f"{who:>14}  {tokenizer.decode(result.tokens[start : start + n])!r}")
        start += n
    totals = {}
    for who, n in chunks:
        totals[who] = totals.get(who, 0) + n
    lines.append(
        "tokens by drafter: "
        + ", ".join(f"{who} {n} in {sum(w == who for w, _ in chunks)} rounds" for who, n in totals.items())
    )
    return "\n".join(lines)


@app.command()
def methods(
    name: Optional[str] = typer.Argument(
        None, help="Explain one method: its paper and steps, and each option (symbol) in words."
    ),
):
    """List the decoding methods with their options and presets (`draftverify methods NAME` explains one)."""
    import dataclasses
    import inspect

    from draftverify.methods import METHODS
    from draftverify.methods.spec import method_class

    if name is not None:
        cls = method_class(name)
        typer.echo(inspect.getdoc(sys.modules[cls.__module__]) + "\n\nOptions:\n" + inspect.getdoc(cls.Config) + "\n")
    for name, cls in sorted(METHODS.items()) if name is None else [(name, METHODS[name])]:
        if name != cls.name:
            typer.echo(f"{name}: another name of {cls.name}")
            continue
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Config))
        typer.echo(f"{name}: {cls.drafts().describe()}")
        typer.echo(f"  options: {fields or 'none'}")
        for preset, values in cls.presets.items():
            typer.echo(f"  preset {preset}: {values}")


# -- the options of `demo` --------------------------------------------------------

DEMO_PROMPT = typer.Option(
    [], help="A chat prompt to answer (repeatable). Default: a chat, a code and a summary prompt."
)
DEMO_TARGET = target_option("Target model", default="qwen2.5-coder-1.5b")  # the real model: what users run
DEMO_METHOD = typer.Option(
    "auto,speculative,ouroboros,specdec-pp,self-speculative,lookahead",
    help="Methods to compare with autoregressive decoding: comma-separated method specs, NAME, NAME:PRESET or "
    "NAME\\[key=value,...]. Default: auto and each seed method.",
)
DEMO_MAX_NEW_TOKENS = typer.Option(96, "--max-new-tokens", "-n", help="New tokens per run.")
DEMO_REPEATS = typer.Option(2, help="Runs of each prompt and method, interleaved; the table shows their medians.")


@app.command()
def demo(
    prompt: list[str] = DEMO_PROMPT,
    target: str = DEMO_TARGET,
    draft: Optional[str] = draft_option(),
    method: str = DEMO_METHOD,
    max_new_tokens: int = DEMO_MAX_NEW_TOKENS,
    repeats: int = DEMO_REPEATS,
    dtype: str = dtype_option(),
    device: str = device_option(),
    backend: str = backend_option(),
):
    """Answer a few prompts with autoregressive decoding and with each METHOD; print the answers and a table of
    speeds, speedups and whether the outputs are identical (exit 1 if any is not).

    Each prompt runs `repeats` times, autoregressive then each method in turn: a speed is the median over the
    runs, a speedup the median of each run's autoregressive time over the method's (a single run moves with the
    machine's load); identical means identical in every run."""
    from draftverify import demo as demo_table
    from draftverify.methods.spec import parse_specs

    specs = parse_specs(method)
    require(specs, "--method names no method: use e.g. auto or lookahead:context")
    require(repeats >= 1, f"--repeats {repeats} must be at least 1")
    prompts = {f"prompt {i + 1}": p for i, p in enumerate(prompt)} if prompt else demo_table.DEMO_PROMPTS
    engine = _load_engine(target, draft, dtype, device, backend=backend)
    typer.echo(f"target: {engine.target.name}   {engine.describe_drafts()}   backend: {engine.describe_backend()}")
    typer.echo("warming up (the first call of a method measures the forward cost curve)...", err=True)
    specs = demo_table.runnable(engine, specs)
    require(specs, "no --method can run on this target: build its drafts with `draftverify build-drafts`")
    rows, same = [], True
    for name, text in prompts.items():
        runs = [demo_table.run(engine, text, specs, max_new_tokens) for _ in range(repeats)]
        row, identical = demo_table.row(name, runs, len(specs))
        same &= identical
        typer.echo(f"\n--- {name}: {text}\n{runs[0][0].text}")
        rows.append(row)
    header = ["prompt", "autoregressive tok/s"] + [
        c for s in specs for c in (f"{s.label} tok/s", "speedup", "identical")
    ]
    typer.echo("\n" + "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows]))
    if not same:
        raise typer.Exit(1)


# -- commands implemented in other modules are registered below --------------------------
from draftverify.bench.cli import bench as _bench  # noqa: E402

app.command("bench")(_bench)
from draftverify.serve.cli import serve as _serve  # noqa: E402

app.command("serve")(_serve)
from draftverify.serve.load_cli import load_command as _load  # noqa: E402

app.command("load")(_load)
from draftverify.tools.train_acceptance_head import (  # noqa: E402
    train_acceptance_head_command as _train_acceptance_head,
)

app.command("train-acceptance-head")(_train_acceptance_head)
app.command("train-head", hidden=True)(_train_acceptance_head)  # the command's old name, kept working
from draftverify.tools.pareto import pareto_command as _pareto  # noqa: E402

app.command("pareto")(_pareto)

from draftverify.tools.make_draft.cli import make_draft as _make_draft  # noqa: E402

app.command("make-draft")(_make_draft)
from draftverify.tools.search_layers import search_layers_command as _search_layers  # noqa: E402

app.command("search-layers")(_search_layers)
from draftverify.tools.quality import quality_command as _quality  # noqa: E402

app.command("quality")(_quality)
from draftverify.loading.fetch_cli import fetch_command as _fetch  # noqa: E402

app.command("fetch")(_fetch)
from draftverify.tools.build_drafts import build_drafts_command as _build_drafts  # noqa: E402

app.command("build-drafts")(_build_drafts)


def run():
    """Run the command line's command -> its exit code (SystemExit's: None, a number, or a message)."""
    try:
        app()
    except DraftVerifyError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    except SystemExit as exc:  # typer ends every command with one
        return exc.code
    return 0


def main() -> None:
    leave(run())


def leave(code) -> None:
    """End the process with `code` (SystemExit's: None, a number, or a message for stderr) without tearing the
    interpreter down: a loaded model's modules and tensors take a sizeable part of a short command's wall clock to
    free, and the system frees them at once. What a normal exit does first is done here too: other threads are
    joined, the atexit handlers run and the standard streams are flushed."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more reaches it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
