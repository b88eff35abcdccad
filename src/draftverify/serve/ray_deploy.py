"""draftverify's OpenAI-compatible server on Ray Serve: N replicas of the same app, one gateway.

    python -m draftverify.serve.ray_cli --replicas 2 --methods auto,autoregressive --num-cpus 1

Each replica (`EngineReplica`, a Ray actor holding `num_cpus` of the cluster) loads the engine and
builds the app of `create_app` — the same routes, scheduler, batching and errors as `draftverify
serve` — and answers the requests the gateway hands it by calling that app in its own process. The
gateway (`Gateway`, Ray Serve's HTTP ingress, no model and no CPU reserved) forwards every request
to a replica through a deployment handle (Ray picks the less loaded of two) and is where a replica's
death becomes an answer: a request whose replica dies before answering gets a 503 in the server's
error format, a stream cut by it ends with an error event and `[DONE]`, as a draining server's does.
Every answer names its replica in the `x-draftverify-replica` and `x-draftverify-pid` headers.

Needs the `ray` extra (`pip install 'draftverify[serve,ray]'`); see docs/ray-serve.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

log = logging.getLogger("draftverify.serve")

APP_NAME = "draftverify"
REPLICA_HEADER = "x-draftverify-replica"  # Ray Serve's id of the replica that answered
PID_HEADER = "x-draftverify-pid"  # its process id on its node
EVENT_STREAM = "text/event-stream"
APP_EXIT_WAIT_S = 5.0  # after the caller left, how long the app may take to withdraw the request
GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)  # the replica is gone or never came


@dataclass(frozen=True)
class EngineArgs:
    """`Engine.load`'s arguments, plain values so that they travel to the replicas."""

    target: str | None = None  # a local HF folder or a .gguf file; None: the default model
    draft: str | None = None  # None: the shipped draft; loaded only when a method needs one
    dtype: str = "auto"
    device: str = "auto"
    backend: str = "auto"

    def load(self, methods):
        from draftverify.engine import Engine
        from draftverify.methods.spec import loads_drafts

        draft = self.draft if loads_drafts(methods) else "none"
        return Engine.load(self.target, draft, dtype=self.dtype, device=self.device, backend=self.backend)


@dataclass(frozen=True)
class RaySettings:
    """How the app is laid out on the cluster."""

    replicas: int = 2
    num_cpus: float = 1.0  # per replica: what Ray reserves for it, and its torch threads (at least 1)
    host: str = "127.0.0.1"  # where Ray Serve's HTTP proxy listens
    port: int = 8000

    def __post_init__(self):
        from draftverify.errors import require

        require(self.replicas >= 1, f"replicas={self.replicas} must be at least 1")
        require(self.num_cpus > 0, f"num_cpus={self.num_cpus} must be positive (CPUs per replica, e.g. 1 or 0.5)")
        require(0 < self.port < 65536, f"port={self.port} must be a TCP port (1..65535): Ray Serve needs a fixed one")

    @property
    def threads(self) -> int:
        return max(1, int(self.num_cpus))


def error_body(status: int, message: str, code: str) -> dict:
    """The server's error format (`serve.protocol.ApiError.body`), built here so that the gateway
    does not import torch."""
    kinds = {429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
    return {"error": {"message": message, "type": kinds.get(status, "error"), "param": None, "code": code}}


def failure(exc: BaseException) -> tuple[int, dict, dict]:
    """Status, JSON body and headers for a request the replicas could not answer."""
    if isinstance(exc, BackPressureError):
        wait = str(max(1, round(exc.retry_after_s or 1)))
        message = f"every replica's queue is full: retry in {wait}s or add replicas (--replicas)"
        return 429, error_body(429, message, "queue_full"), {"Retry-After": wait}
    if isinstance(exc, GONE):
        message = f"the replica serving this request stopped ({type(exc).__name__}): retry, another replica answers"
        return 503, error_body(503, message, "replica_unavailable"), {}
    return (
        500,
        error_body(500, f"the replica failed: {type(exc).__name__}: {exc}".splitlines()[0], "replica_failed"),
        {},
    )


async def call_app(app, method: str, path: str, query: bytes, headers: list, body: bytes):
    """One HTTP request through the ASGI `app` in this process. Yields `("whole", status, headers,
    body)` for an ordinary answer, or `("start", status, headers)` and then `("chunk", bytes)`
    items for an event stream, as the app sends them. If the caller stops listening, the app
    sees `http.disconnect` (and withdraws the request, as it does for a client that hangs up)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(bytes(k), bytes(v)) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    unread = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if unread:
            return unread.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(scope, receive, sent.put)
        except Exception:  # Starlette has answered 500 already if it could
            log.exception("%s %s failed", method, path)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        async for item in _replies(sent):
            yield item
    finally:
        gone.set()
        await asyncio.wait([task], timeout=APP_EXIT_WAIT_S)
        task.cancel()


async def _replies(sent: asyncio.Queue):
    """The app's ASGI messages from `sent` as `call_app`'s items."""
    start = await sent.get()
    if start is None:
        yield (
            "whole",
            500,
            [("content-type", "application/json")],
            json.dumps(error_body(500, "the app failed", "generation_failed")).encode(),
        )
        return
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers", [])]
    streaming = any(k.lower() == "content-type" and v.startswith(EVENT_STREAM) for k, v in headers)
    if streaming:
        yield "start", start["status"], headers
    parts = []
    while (message := await sent.get()) is not None:
        if message["type"] != "http.response.body":
            continue
        if streaming and message.get("body"):
            yield "chunk", message["body"]
        elif not streaming:
            parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    if not streaming:
        yield "whole", start["status"], headers, b"".join(parts)


class EngineReplica:
    """One replica: the engine and draftverify's app (`create_app`) with its lifespan running."""

    async def __init__(self, load: EngineArgs, config, threads: int):
        import torch

        from draftverify.serve.app import create_app

        torch.set_num_threads(threads)
        self.app = create_app(load.load(config.methods), config)
        self.life = self.app.router.lifespan_context(self.app)  # starts the scheduler; on exit drains, saves pools
        await self.life.__aenter__()
        replica = serve.get_replica_context().replica_id.unique_id
        self.identity = [(REPLICA_HEADER, replica), (PID_HEADER, str(os.getpid()))]

    async def request(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """The app's answer to one request, as `call_app` items, with this replica's headers added."""
        async for item in call_app(self.app, method, path, query, headers, body):
            if item[0] in ("whole", "start"):
                item = (item[0], item[1], item[2] + self.identity, *item[3:])
            yield item

    async def __del__(self):
        await self.life.__aexit__(None, None, None)


def gateway_app(replicas) -> FastAPI:
    """The HTTP ingress: every route goes to a replica through `replicas` (a deployment handle)."""
    app = FastAPI(title="draftverify on Ray Serve")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(request: Request, path: str):
        body = await request.body()
        call = replicas.options(stream=True).request.remote(
            request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body
        )
        try:
            first = await call.__anext__()
        except Exception as exc:
            status, content, headers = failure(exc)
            return JSONResponse(content, status_code=status, headers=headers)
        headers = {k: v for k, v in first[2] if k.lower() != "content-length"}
        if first[0] == "whole":
            return Response(first[3], status_code=first[1], headers=headers)
        return StreamingResponse(rest_of_stream(call), status_code=first[1], headers=headers)

    return app


async def rest_of_stream(call):
    """A stream's remaining chunks; if its replica dies, an error event and `[DONE]` end it."""
    try:
        async for item in call:
            yield item[1]
    except Exception as exc:
        _, content, _ = failure(exc)
        yield f"data: {json.dumps(content)}\n\ndata: [DONE]\n\n"
    finally:
        call.cancel()  # a client that left: the replica's generator stops and the app withdraws the request


@serve.ingress()
class Gateway:
    """Ray Serve's ingress deployment around `gateway_app`."""

    def __init__(self, replicas):
        self.replicas = replicas

    def __serve_build_asgi_app__(self):
        return gateway_app(self.replicas)


def build(settings: RaySettings, load: EngineArgs, config):
    """The Ray Serve application: `settings.replicas` engine replicas behind one gateway."""
    replicas = serve.deployment(EngineReplica).options(
        name="draftverify-engine",
        num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": settings.num_cpus},
        # a replica takes what its scheduler takes (the batch and its line): past that, Ray waits for room
        max_ongoing_requests=config.max_batch + config.max_queue,
        graceful_shutdown_timeout_s=config.shutdown_grace_s + 5,
    )
    gateway = serve.deployment(Gateway).options(
        name="draftverify-gateway", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000
    )
    return gateway.bind(replicas.bind(load, config, settings.threads))


def package_path() -> str:
    """The folder that holds the draftverify package this process imported, for the workers' PYTHONPATH."""
    return str(Path(__file__).resolve().parents[2])


def connect(address: str | None, num_cpus: float | None = None) -> None:
    """Join the Ray cluster at `address` ('auto': the one started with `ray start`), or start a local
    one with `num_cpus` CPUs (None: all of this machine's) whose workers import this draftverify."""
    import ray

    if address:
        ray.init(address=address)
        return
    paths = [package_path(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in paths)}
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})


def start(settings: RaySettings, load: EngineArgs, config) -> str:
    """Deploy on the connected cluster (see `connect`); returns the base URL once every replica is up."""
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build(settings, load, config), name=APP_NAME, route_prefix="/")
    return f"http://{settings.host}:{settings.port}"


def stop(graceful: bool = True) -> None:
    """Take the app down (each replica drains and saves its pools) and leave the cluster. With
    `graceful=False`, only leave it: a local cluster's processes end with it, undrained."""
    import ray

    try:
        if graceful:
            serve.shutdown()
    finally:
        ray.shutdown()
