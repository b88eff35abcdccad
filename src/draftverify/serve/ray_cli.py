"""`python -m draftverify.serve.ray_cli`: deploy draftverify's server on Ray Serve and serve until
SIGINT/SIGTERM, then take it down (see draftverify.serve.ray_deploy and docs/ray-serve.md)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

# (flags, keyword arguments of argparse's add_argument); the help says what each option does
OPTIONS = (
    (("--replicas",), dict(type=int, default=2, help="Engine replicas, each a Ray actor with its own model copy.")),
    (
        ("--num-cpus",),
        dict(
            type=float,
            default=1.0,
            help="CPUs Ray reserves per replica (fractions allowed, e.g. 0.5); also its torch threads (at least 1).",
        ),
    ),
    (
        ("--address",),
        dict(
            default=None,
            help="Ray cluster to join ('auto': the one `ray start --head` started here; ray://host:10001). "
            "Default: start a local cluster in this process.",
        ),
    ),
    (("--cluster-cpus",), dict(type=float, default=None, help="CPUs of the local cluster (default: all).")),
    (("--target", "-t"), dict(default=None, help="Target model: a local HF folder or a .gguf file (default model).")),
    (
        ("--draft", "-d"),
        dict(default=None, help="Draft spec for the methods that need one, as in `draftverify serve`."),
    ),
    (("--methods", "-m"), dict(default="auto", help="Methods to load, comma-separated; the first is the default.")),
    (("--host",), dict(default="127.0.0.1", help="Address Ray Serve's HTTP proxy listens on.")),
    (("--port",), dict(type=int, default=8000, help="Port Ray Serve's HTTP proxy listens on.")),
    (("--model-name",), dict(default=None, help='The model id clients send as "model" (default: the target\'s name).')),
    (("--max-queue",), dict(type=int, default=16, help="Requests that may wait per replica; more get 429.")),
    (("--max-batch",), dict(type=int, default=8, help="Requests a replica decodes together.")),
    (("--timeout",), dict(type=float, default=600.0, help="Seconds a request may take; later it is cut off (504).")),
    (("--shutdown-grace",), dict(type=float, default=30.0, help="Seconds a stopping replica's generations may go on.")),
    (("--default-max-tokens",), dict(type=int, default=256, help="New tokens when a request gives no max_tokens.")),
    (("--pool-file",), dict(type=Path, default=None, help="Phrase pool file; each replica must have its own path.")),
    (("--dtype",), dict(default="auto", help="Weights dtype: auto, fp32, bf16 or fp16.")),
    (("--device",), dict(default="auto", help="Device: auto, cpu, cuda or cuda:N.")),
    (("--backend",), dict(default="auto", help="Forward path: auto, static or eager.")),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m draftverify.serve.ray_cli",
        description="Serve draftverify's OpenAI-compatible API from N replicas on Ray Serve.",
    )
    for flags, kwargs in OPTIONS:
        p.add_argument(*flags, **kwargs)
    return p


def settings(args: argparse.Namespace):
    """The deployment's three parts from the parsed options (each validated on construction)."""
    from draftverify.serve.app import ServeConfig, parse_methods
    from draftverify.serve.ray_deploy import EngineArgs, RaySettings

    config = ServeConfig(
        methods=parse_methods(args.methods),
        model_name=args.model_name,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        timeout_s=args.timeout,
        shutdown_grace_s=args.shutdown_grace,
        default_max_tokens=args.default_max_tokens,
        pool_file=args.pool_file,
    )
    load = EngineArgs(args.target, args.draft, args.dtype, args.device, args.backend)
    return RaySettings(args.replicas, args.num_cpus, args.host, args.port), load, config


def main(argv: list[str] | None = None) -> None:
    from draftverify.errors import DraftVerifyError
    from draftverify.serve import ray_deploy

    args = parser().parse_args(argv)
    try:
        where, load, config = settings(args)
    except DraftVerifyError as exc:
        sys.exit(f"error: {exc}")
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    ray_deploy.connect(args.address, args.cluster_cpus)
    try:
        url = ray_deploy.start(where, load, config)
        methods = ", ".join(s.label for s in config.methods)
        print(f"serving with {methods} on {url}/v1 ({where.replicas} replicas)", flush=True)
        while not stopping.wait(1.0):
            pass
    finally:
        ray_deploy.stop()


if __name__ == "__main__":
    main()
