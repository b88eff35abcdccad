"""`draftverify serve`: the OpenAI-compatible server on the command line (heavy imports inside the command;
no import of draftverify.cli here, so that `python -m draftverify.cli` has no import cycle)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import backend_option, device_option, draft_option, dtype_option, target_option

# -- the options of `serve` -------------------------------------------------------

SERVE_METHODS = typer.Option(
    "auto",
    "--methods",
    "--method",
    "-m",
    help="Methods to load, comma-separated, as in `draftverify bench`: name, name:preset or "
    "name\\[key=value,...], e.g. 'speculative\\[k=4],autoregressive' (quote it in the shell). The first is the "
    'default; a request picks another with the field "method".',
)
SERVE_HOST = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
SERVE_PORT = typer.Option(8000, help="Port to listen on (0 = any free port; the chosen one is printed).")
SERVE_MODEL_NAME = typer.Option(None, help='The model id clients send as "model" (default: the target\'s name).')
SERVE_MAX_QUEUE = typer.Option(
    16, help="Requests that may wait for a place in the running batch; more are answered 429 with Retry-After."
)
SERVE_MAX_BATCH = typer.Option(
    8, help="Requests decoded together (continuous batching: they join and leave between steps; 1 = one at a time)."
)
SERVE_TIMEOUT = typer.Option(
    600.0, help="Seconds a request may take from arrival to its last token; later it is cut off (504)."
)
SERVE_SHUTDOWN_GRACE = typer.Option(
    30.0, help="On SIGINT/SIGTERM: seconds the running generation may go on; waiting requests get 503 at once."
)
SERVE_DEFAULT_MAX_TOKENS = typer.Option(
    256, help="New tokens when a request gives no max_tokens (always capped by the context)."
)
SERVE_POOL_FILE = typer.Option(
    None,
    help="Phrase pool file of the one loaded pool method (ouroboros, lookahead): loaded at start if it exists, "
    "shared by all requests, saved after each and on shutdown.",
)
SERVE_DEVICE_MAP = typer.Option(
    None,
    help="Spread the target over several GPUs with accelerate, e.g. 'auto' (then --device is ignored for the target).",
)
SERVE_PROMPT_PART = typer.Option(
    128,
    help="Feed a prompt longer than this many tokens that many a step while other requests decode, so their "
    "streams go on and shorter requests join during its prefill; 0: whole, as llama.cpp's server does.",
)
SERVE_LOG_LEVEL = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug.")


def serve(
    target: Optional[str] = target_option(),
    draft: Optional[str] = draft_option("Draft model for the methods that need one"),
    methods: str = SERVE_METHODS,
    host: str = SERVE_HOST,
    port: int = SERVE_PORT,
    model_name: Optional[str] = SERVE_MODEL_NAME,
    max_queue: int = SERVE_MAX_QUEUE,
    max_batch: int = SERVE_MAX_BATCH,
    prompt_part: int = SERVE_PROMPT_PART,
    timeout: float = SERVE_TIMEOUT,
    shutdown_grace: float = SERVE_SHUTDOWN_GRACE,
    default_max_tokens: int = SERVE_DEFAULT_MAX_TOKENS,
    pool_file: Optional[Path] = SERVE_POOL_FILE,
    dtype: str = dtype_option(),
    device: str = device_option(),
    device_map: Optional[str] = SERVE_DEVICE_MAP,
    backend: str = backend_option(),
    log_level: str = SERVE_LOG_LEVEL,
):
    """Serve the target behind an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, streaming,
    /metrics)."""
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
        prompt_part=prompt_part,
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
