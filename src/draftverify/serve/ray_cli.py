"""`python -m draftverify.serve.ray_cli`: deploy draftverify's server on Ray Serve and serve until
SIGINT/SIGTERM, then take it down (see draftverify.serve.ray_deploy and docs/ray-serve.md). A typer
command like the rest of the CLI; `settings` turns its options into the deployment's three parts."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import backend_option, device_option, draft_option, dtype_option, target_option
from draftverify.serve.cli import (
    SERVE_DEFAULT_MAX_TOKENS,
    SERVE_MAX_GAP_MS,
    SERVE_MODEL_NAME,
    SERVE_PROMPT_PART,
    SERVE_TIMEOUT,
)

REPLICAS = typer.Option(2, help="Engine replicas, each a Ray actor with its own model copy.")
NUM_CPUS = typer.Option(
    1.0, help="CPUs Ray reserves per replica (fractions allowed, e.g. 0.5); also its torch threads (at least 1)."
)
ADDRESS = typer.Option(
    None,
    help="Ray cluster to join ('auto': the one `ray start --head` started here; ray://host:10001). "
    "Default: start a local cluster in this process.",
)
CLUSTER_CPUS = typer.Option(None, help="CPUs of the local cluster (default: all).")
METHODS = typer.Option("auto", "--methods", "-m", help="Methods to load, comma-separated; the first is the default.")
HOST = typer.Option("127.0.0.1", help="Address Ray Serve's HTTP proxy listens on.")
PORT = typer.Option(8000, help="Port Ray Serve's HTTP proxy listens on.")
MAX_QUEUE = typer.Option(16, help="Requests that may wait per replica; more get 429.")
MAX_BATCH = typer.Option(8, help="Requests a replica decodes together.")
SHUTDOWN_GRACE = typer.Option(30.0, help="Seconds a stopping replica's generations may go on.")
POOL_FILE = typer.Option(None, help="Phrase pool file; each replica must have its own path.")

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(help="Serve draftverify's OpenAI-compatible API from N replicas on Ray Serve.")
def ray_serve(
    replicas: int = REPLICAS,
    num_cpus: float = NUM_CPUS,
    address: Optional[str] = ADDRESS,
    cluster_cpus: Optional[float] = CLUSTER_CPUS,
    target: Optional[str] = target_option(),
    draft: Optional[str] = draft_option("Draft model for the methods that need one"),
    methods: str = METHODS,
    host: str = HOST,
    port: int = PORT,
    model_name: Optional[str] = SERVE_MODEL_NAME,
    max_queue: int = MAX_QUEUE,
    max_batch: int = MAX_BATCH,
    prompt_part: int = SERVE_PROMPT_PART,
    max_gap_ms: float = SERVE_MAX_GAP_MS,
    timeout: float = SERVE_TIMEOUT,
    shutdown_grace: float = SHUTDOWN_GRACE,
    default_max_tokens: int = SERVE_DEFAULT_MAX_TOKENS,
    pool_file: Optional[Path] = POOL_FILE,
    dtype: str = dtype_option(),
    device: str = device_option(),
    backend: str = backend_option(),
):
    options = dict(locals())  # the options, before anything else is named here
    from draftverify.errors import DraftVerifyError

    address, cluster_cpus = options.pop("address"), options.pop("cluster_cpus")
    try:
        where, load, config = settings(**options)
    except DraftVerifyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    run(where, load, config, address, cluster_cpus)


def settings(**options):
    """The deployment's three parts (RaySettings, EngineArgs, ServeConfig) from the command's options (each
    validated on construction)."""
    from draftverify.errors import DraftVerifyError
    from draftverify.serve.app import ServeConfig, parse_methods

    o = options
    config = ServeConfig(
        methods=parse_methods(o["methods"]),
        model_name=o["model_name"],
        max_queue=o["max_queue"],
        max_batch=o["max_batch"],
        prompt_part=o["prompt_part"],
        max_gap_ms=o["max_gap_ms"],
        timeout_s=o["timeout"],
        shutdown_grace_s=o["shutdown_grace"],
        default_max_tokens=o["default_max_tokens"],
        pool_file=o["pool_file"],
    )
    try:
        from draftverify.serve.ray_deploy import EngineArgs, RaySettings
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "ray":
            raise
        raise DraftVerifyError("Ray Serve is not installed: pip install 'draftverify[serve,ray]'") from exc
    load = EngineArgs(o["target"], o["draft"], o["dtype"], o["device"], o["backend"])
    return RaySettings(o["replicas"], o["num_cpus"], o["host"], o["port"]), load, config


def run(where, load, config, address: str | None, cluster_cpus: float | None) -> None:
    """Deploy on the cluster at `address` (a local one when None) and serve until SIGINT/SIGTERM."""
    from draftverify.serve import ray_deploy

    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray_deploy.connect(address, cluster_cpus)
        try:
            url = ray_deploy.start(where, load, config)
            methods = ", ".join(s.label for s in config.methods)
            typer.echo(f"serving with {methods} on {url}/v1 ({where.replicas} replicas)")
            while not stopping.wait(1.0):
                pass
        finally:
            ray_deploy.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="python -m draftverify.serve.ray_cli")


if __name__ == "__main__":
    main()
