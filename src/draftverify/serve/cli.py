"""`draftverify serve`: the OpenAI-compatible server on the command line (heavy imports inside the command;
no import of draftverify.cli here, so that `python -m draftverify.cli` has no import cycle)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def serve(
    target: Optional[str] = typer.Option(
        None, "--target", "-t", help="Target model: a local HF folder or a .gguf file. Default: SmolLM2-135M-Instruct."
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        help="Draft model for the methods that need one (see `draftverify generate --help`). Default: the shipped draft, else self:layers=8.",
    ),
    methods: str = typer.Option(
        "auto",
        "--methods",
        "--method",
        "-m",
        help="Methods to load, comma-separated, as in `draftverify bench`: name, name:preset or name\\[key=value,...], e.g. "
        "'speculative\\[k=4],autoregressive' (quote it in the shell). The first is the default; a request picks another with the field \"method\".",
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, help="Port to listen on (0 = any free port; the chosen one is printed)."),
    model_name: Optional[str] = typer.Option(
        None, help='The model id clients send as "model" (default: the target\'s name).'
    ),
    max_queue: int = typer.Option(
        16, help="Requests that may wait for a place in the running batch; more are answered 429 with Retry-After."
    ),
    max_batch: int = typer.Option(
        8, help="Requests decoded together (continuous batching: they join and leave between steps; 1 = one at a time)."
    ),
    timeout: float = typer.Option(
        600.0, help="Seconds a request may take from arrival to its last token; later it is cut off (504)."
    ),
    shutdown_grace: float = typer.Option(
        30.0, help="On SIGINT/SIGTERM: seconds the running generation may go on; waiting requests get 503 at once."
    ),
    default_max_tokens: int = typer.Option(
        256, help="New tokens when a request gives no max_tokens (always capped by the context)."
    ),
    pool_file: Optional[Path] = typer.Option(
        None,
        help="Phrase pool file of the one loaded pool method (ouroboros, lookahead): loaded at start if it exists, shared by all requests, saved after each and on shutdown.",
    ),
    dtype: str = typer.Option(
        "auto",
        help="Weights dtype and target arithmetic: auto, fp32, bf16, fp16 or q8 (docs/q8.md).",
    ),
    device: str = typer.Option("auto", help="Device: auto, cpu, cuda or cuda:N."),
    device_map: Optional[str] = typer.Option(
        None,
        help="Spread the target over several GPUs with accelerate, e.g. 'auto' (then --device is ignored for the target).",
    ),
    backend: str = typer.Option(
        "auto", help="Forward path: auto, static or eager (see `draftverify generate --help`)."
    ),
    log_level: str = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug."),
):
    """Serve the target behind an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, streaming, /metrics)."""
    from draftverify.engine import Engine
    from draftverify.methods import METHODS
    from draftverify.serve.app import ServeConfig, create_app, parse_methods
    from draftverify.serve.server import Server

    specs = parse_methods(methods)
    config = ServeConfig(
        methods=specs,
        model_name=model_name,
        max_queue=max_queue,
        max_batch=max_batch,
        timeout_s=timeout,
        shutdown_grace_s=shutdown_grace,
        default_max_tokens=default_max_tokens,
        pool_file=pool_file,
    )
    engine = Engine.load(
        target,
        draft if any(METHODS[s.name].loads_draft() for s in specs) else "none",
        dtype=dtype,
        device=device,
        device_map=device_map,
        backend=backend,
    )
    app = create_app(engine, config)
    name = app.state.service.model_name

    def announce(bound: int) -> None:
        typer.echo(f"serving {name} with {', '.join(s.label for s in specs)} on http://{host}:{bound}/v1")

    try:
        Server(app, host=host, port=port, log_level=log_level, announce=announce).run_on_main()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on
        pass
