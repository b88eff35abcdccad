"""`draftverify serve`: the OpenAI-compatible server on the command line (heavy imports inside the command;
no import of draftverify.cli here, so that `python -m draftverify.cli` has no import cycle)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

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
    512,
    help="Feed a long prompt at most this many tokens a step while other requests decode, so their streams go on "
    "and shorter requests join during its prefill (--max-gap-ms sizes the parts); 0: whole, as llama.cpp's server "
    "does.",
)
SERVE_MAX_GAP_MS = typer.Option(
    250.0,
    help="Size each part of a long prompt so that the step feeding it, priced by the target's measured cost curve, "
    "takes at most this many milliseconds, beside the rows the other requests feed (at least 8 tokens a step); "
    "0: parts of --prompt-part tokens.",
)
SERVE_LOG_LEVEL = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug.")
SERVE_API_KEY = typer.Option(
    None,
    "--api-key",
    help="Require 'Authorization: Bearer KEY' on every route but /health (repeat for several keys; prefer "
    "--api-key-file, since a command line is visible to other users).",
)
SERVE_API_KEY_FILE = typer.Option(None, help="File of API keys, one a line (# comments); adds to --api-key.")
SERVE_SSL_CERTFILE = typer.Option(None, help="Serve HTTPS with this PEM certificate (with --ssl-keyfile).")
SERVE_SSL_KEYFILE = typer.Option(None, help="The PEM private key of --ssl-certfile.")
SERVE_CORS_ORIGIN = typer.Option(
    None, "--cors-origin", help="Browser origin allowed to call the server, e.g. https://example.com or * (repeatable)."
)
SERVE_MAX_TOKENS = typer.Option(
    None, help="Server-wide cap on a request's new tokens: a request asking more is clamped to it (default: none)."
)
SERVE_STRICT = typer.Option(
    False, help="Refuse llama-server's request fields (n_probs, cache_prompt, id_slot) as unknown, as OpenAI would."
)
SERVE_CHAT_TEMPLATE = typer.Option(
    None, help="A Jinja chat template file used for /v1/chat/completions instead of the model's own."
)
SERVE_KEEP_ALIVE = typer.Option(
    15.0, help="Seconds of silence after which a stream sends an SSE comment ': keep-alive' (0: never)."
)
SERVE_PREFIX_CACHE_MB = typer.Option(
    1024,
    help="Budget in MiB of the prefix cache: a request reuses the keys and values of the longest prompt prefix an "
    "earlier request computed (a chat's earlier turns), exactly; least recently used entries go first (0: off).",
)


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
    max_gap_ms: float = SERVE_MAX_GAP_MS,
    timeout: float = SERVE_TIMEOUT,
    shutdown_grace: float = SERVE_SHUTDOWN_GRACE,
    default_max_tokens: int = SERVE_DEFAULT_MAX_TOKENS,
    pool_file: Optional[Path] = SERVE_POOL_FILE,
    dtype: str = dtype_option(),
    device: str = device_option(),
    device_map: Optional[str] = SERVE_DEVICE_MAP,
    backend: str = backend_option(),
    log_level: str = SERVE_LOG_LEVEL,
    api_key: Optional[List[str]] = SERVE_API_KEY,
    api_key_file: Optional[Path] = SERVE_API_KEY_FILE,
    ssl_certfile: Optional[Path] = SERVE_SSL_CERTFILE,
    ssl_keyfile: Optional[Path] = SERVE_SSL_KEYFILE,
    cors_origin: Optional[List[str]] = SERVE_CORS_ORIGIN,
    max_tokens: Optional[int] = SERVE_MAX_TOKENS,
    strict: bool = SERVE_STRICT,
    chat_template: Optional[Path] = SERVE_CHAT_TEMPLATE,
    keep_alive: float = SERVE_KEEP_ALIVE,
    prefix_cache_mb: int = SERVE_PREFIX_CACHE_MB,
):
    """Serve the target behind an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, streaming,
    /metrics)."""
    from draftverify.engine import Engine
    from draftverify.methods.spec import loads_drafts
    from draftverify.serve.access import check_tls, config_fields
    from draftverify.serve.app import ServeConfig, create_app, parse_methods

    specs = parse_methods(methods)
    check_tls(ssl_certfile, ssl_keyfile)
    config = ServeConfig(
        methods=specs,
        model_name=model_name,
        max_queue=max_queue,
        max_batch=max_batch,
        prompt_part=prompt_part,
        max_gap_ms=max_gap_ms,
        timeout_s=timeout,
        shutdown_grace_s=shutdown_grace,
        default_max_tokens=default_max_tokens,
        pool_file=pool_file,
        prefix_cache_mb=prefix_cache_mb,
        **config_fields(api_key, api_key_file, cors_origin, max_tokens, strict, chat_template, keep_alive),
    )
    drafts = draft if loads_drafts(specs) else "none"
    engine = Engine.load(target, drafts, dtype=dtype, device=device, device_map=device_map, backend=backend)
    app = create_app(engine, config)
    launch(app, host, port, log_level, ssl_certfile, ssl_keyfile)


def launch(app, host: str, port: int, log_level: str, certfile: Optional[Path], keyfile: Optional[Path]) -> None:
    """Serve `app` until SIGINT/SIGTERM (HTTPS with the TLS files), saying where once it listens."""
    from draftverify.serve.server import Server

    service = app.state.service
    labels = ", ".join(s.label for s in service.config.methods)

    def announce(bound: int) -> None:
        where = f"{'https' if certfile else 'http'}://{host}:{bound}/v1"
        typer.echo(f"serving {service.model_name} with {labels} on {where}")

    tls = {"ssl_certfile": certfile and str(certfile), "ssl_keyfile": keyfile and str(keyfile)}
    try:
        Server(app, host=host, port=port, log_level=log_level, announce=announce, **tls).run_on_main()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on
        pass
