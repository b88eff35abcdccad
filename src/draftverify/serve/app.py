"""The FastAPI app: OpenAI-compatible routes over one Engine.

    engine = Engine.load()
    app = create_app(engine, ServeConfig(methods=parse_methods("speculative,autoregressive")))

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events), GET /v1/models, GET /health, GET /metrics, and llama-server's /tokenize,
/detokenize and /props (serve/llama.py); API keys and CORS in serve/access.py. Each request is validated
and tokenised on the event loop, then waits in the scheduler's line for the model; see
docs/serve.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from draftverify.engine import Engine
from draftverify.errors import DraftVerifyError, require
from draftverify.methods import METHODS
from draftverify.methods.spec import MethodSpec, parse_specs
from draftverify.serve import access, provenance
from draftverify.serve.choices import choice_jobs, outcomes, stream_choices, whole_response
from draftverify.serve.extras import check_format, knobs
from draftverify.serve.http import CountRequests, read_body
from draftverify.serve.keepalive import keep_alive
from draftverify.serve.llama import check_template
from draftverify.serve.llama import routes as llama_routes
from draftverify.serve.metrics import Metrics
from draftverify.serve.page import routes as page_routes
from draftverify.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    parse_request,
)
from draftverify.serve.scheduler import Job, Outcome, Scheduler, Ticket, timeout_error
from draftverify.serve.tools import ToolPlan, chat_prompt, tool_plan
from draftverify.serve.warmup import warm_up

log = logging.getLogger("draftverify.serve")

POLL_S = 0.25  # how often a waiting handler checks for a gone client and its deadline
CUT_GRACE_S = 2.0  # past the deadline, how long to wait for the worker to cut a running request


def parse_methods(text: str) -> tuple[MethodSpec, ...]:
    """Comma-separated method specs (`draftverify.methods.spec`): `name`, `name:preset`,
    `name[key=value,...]` or `name:preset[key=value,...]`, each validated against its method. A
    spec's label (as written) is what clients send as `method`."""
    specs = parse_specs(text)
    require(specs, "no method given: pass e.g. --methods speculative,autoregressive")
    return tuple(specs)


def with_pool_file(specs: tuple[MethodSpec, ...], path: Path) -> tuple[MethodSpec, ...]:
    """Give the one method that keeps a phrase pool (a `pool_file` option) the server's pool
    file, with `reuse=True` unless the spec says otherwise, so that its pool is shared by every
    request, saved after each and loaded at start."""
    pooled = [s for s in specs if "pool_file" in {f.name for f in dataclasses.fields(METHODS[s.name].Config)}]
    names = ", ".join(s.label for s in specs)
    require(
        len(pooled) == 1,
        f"--pool-file needs exactly one loaded method with a pool (ouroboros, lookahead), "
        f"found {len(pooled)} among {names}",
    )
    spec = pooled[0]
    require(
        "pool_file" not in dict(spec.options), f"{spec.label} names a pool_file and so does --pool-file: give it once"
    )
    options = {"reuse": True, **dict(spec.options), "pool_file": str(path)}
    return tuple(dataclasses.replace(s, options=tuple(options.items())) if s is spec else s for s in specs)


@dataclass(frozen=True)
class ServeConfig:
    methods: tuple[MethodSpec, ...] = (MethodSpec("auto", "auto", None, ()),)  # the first is the default
    model_name: str | None = None  # the id clients send as `model`; default: the target's name
    max_queue: int = 16  # requests that may wait for a place in the running batch; more get 429
    max_batch: int = 8  # requests decoded together (continuous batching; 1 = one at a time)
    prompt_part: int = 512  # feed a longer prompt at most this many rows a step while others decode (`batch.Batch`)
    max_gap_ms: float = 250.0  # fewer: a step's forward priced within this by the cost curve; 0: parts of prompt_part
    timeout_s: float = 600.0  # per request, from arrival to the last token
    shutdown_grace_s: float = 30.0  # on shutdown, how long the running generation may go on
    default_max_tokens: int = 256  # when a request gives no max_tokens
    max_body_bytes: int = 4 << 20
    pool_file: Path | None = (
        None  # the pool of the one loaded pool method (ouroboros, lookahead): loaded at start, saved
    )
    api_keys: tuple[str, ...] = ()  # any: every route but /health needs `Authorization: Bearer <key>` (access.py)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the server ("*": any)
    max_tokens: int | None = None  # server-wide cap on a request's new tokens: larger asks are clamped to it
    strict: bool = False  # refuse llama-server's fields (n_probs, cache_prompt, id_slot) as unknown too
    chat_template: str | None = None  # a Jinja chat template (its text) used instead of the model's
    keep_alive_s: float = 15.0  # a stream's `: keep-alive` comment after this many silent seconds; 0: none
    prefix_cache_mb: int = 1024  # the engine's prefix cache budget (`draftverify.prefix_cache`); 0: off

    def __post_init__(self):
        require(self.methods, "no method given: pass e.g. --methods speculative")
        require(self.max_queue >= 0, f"max_queue={self.max_queue} must be at least 0")
        require(self.max_batch >= 1, f"max_batch={self.max_batch} must be at least 1")
        require(self.prompt_part >= 0, f"prompt_part={self.prompt_part} must be at least 0 (0: prompts fed whole)")
        require(self.max_gap_ms >= 0, f"max_gap_ms={self.max_gap_ms} must be at least 0 (0: parts of prompt_part rows)")
        require(self.timeout_s > 0, f"timeout={self.timeout_s} must be positive (seconds)")
        require(self.shutdown_grace_s >= 0, f"shutdown_grace={self.shutdown_grace_s} must be at least 0 (seconds)")
        require(self.prefix_cache_mb >= 0, f"prefix_cache_mb={self.prefix_cache_mb} must be at least 0 (0: off)")
        require(self.default_max_tokens >= 1, f"default_max_tokens={self.default_max_tokens} must be at least 1")
        access.check_access(self)


class Service:
    """What the routes share: the engine and its loaded methods, the scheduler, the metrics."""

    def __init__(self, engine: Engine, config: ServeConfig):
        self.engine, self.config = engine, config
        self.model_name = config.model_name or engine.target.name
        self.created = int(time.time())
        self.chat_template = config.chat_template and check_template(engine.target.tokenizer, config.chat_template)
        specs = with_pool_file(config.methods, config.pool_file) if config.pool_file else config.methods
        self.methods = {spec.label: spec for spec in specs}  # as clients name them -> what runs
        instances = [
            engine.method(s.name, s.preset, **dict(s.options)) for s in specs
        ]  # built once, reused per request
        engine.use_prefix_cache(config.prefix_cache_mb << 20)  # before the warm-up, which fills it (serve/warmup.py)
        self.pooled = warm_up(engine, specs, instances, self.chat_template)  # methods whose pool lives in a file
        self.metrics = Metrics(prefix_cache=lambda: engine.prefix_cache)
        self.scheduler = Scheduler(
            engine, config.max_queue, self.metrics, config.max_batch, config.prompt_part, config.max_gap_ms / 1000
        )

    def start(self) -> None:
        self.scheduler.start()

    def drain(self, grace_s: float) -> None:
        self.scheduler.drain(grace_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the worker, then save the pools (their methods also save after every request)."""
        if not self.scheduler.stop(timeout_s):
            log.error("a generation is still running after %.0fs: pools not saved", timeout_s)
            return
        for method in self.pooled:
            if method.config.reuse:
                method.save_pool()
                log.info("saved pool %s (%d phrases)", method.config.pool_file, len(method.pool))

    def job(self, req: CompletionRequest | ChatRequest, kind: str, tools: ToolPlan | None = None) -> Job:
        """Check the request against the model and the loaded methods; tokenise its prompt. `tools`: what the
        reply may call (its grammar joins the knobs)."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here: use {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        spec = self._method(req.method)
        field = "messages" if kind == "chat" else "prompt"
        try:
            if kind == "chat":
                messages, shown = chat_prompt(req, self.chat_template or self.engine.target.tokenizer.chat_template)
                ids = self.engine.encode(messages, chat=True, chat_template=self.chat_template, tools=shown)
            else:
                vocab = self.engine.target.model.get_input_embeddings().num_embeddings
                bad = [t for t in req.prompt if not 0 <= t < vocab] if isinstance(req.prompt, list) else []
                require(not bad, f"token id {bad[:1]} is outside the vocabulary 0..{vocab - 1}: send valid ids")
                ids = self.engine.encode(req.prompt)
        except DraftVerifyError as exc:
            raise ApiError(400, str(exc), param=field, code="invalid_prompt") from exc
        asked_field = (
            "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        )
        asked = access.capped(getattr(req, asked_field), self.config.max_tokens)
        context = self.engine.target_runner.max_length
        room = context - len(ids) if context else None
        if asked is not None and room is not None and asked > room:
            raise ApiError(
                400,
                f"{asked_field}={asked} is too large: the prompt has {len(ids)} tokens and the context {context}, "
                f"so at most {room} new tokens fit",
                param=asked_field,
                code="context_length_exceeded",
            )
        default = access.capped(self.config.default_max_tokens, self.config.max_tokens)
        max_tokens = asked or min(default, room or default)
        check_format(self.engine, req.response_format)
        return Job(
            ids,
            spec.label,
            spec.name,
            spec.preset,
            dict(spec.options),
            max_tokens,
            req.temperature,
            req.top_p,
            req.top_k,
            req.seed,
            tuple(req.stop),
            {**knobs(req, kind), "response_format": tools.response_format()} if tools else knobs(req, kind),
            provenance=provenance.wanted(req),
        )

    def _method(self, asked: str | None) -> MethodSpec:
        """The loaded method a request asks for: by its label, by its name if only one has it, else the first."""
        specs = list(self.methods.values())
        by_name = [s for s in specs if s.name == asked]
        if asked is None or asked in self.methods or len(by_name) == 1:
            return specs[0] if asked is None else self.methods.get(asked) or by_name[0]
        raise ApiError(
            400,
            f"unknown method {asked!r}: this server runs {', '.join(self.methods)}",
            param="method",
            code="method_not_found",
        )

    async def follow(self, ticket: Ticket, request: Request | None = None):
        """The ticket's events as they come, ending with its Outcome; nothing more if `request`'s
        client disconnects. Gives up with a 504 past the deadline. Always withdraws the ticket."""
        next_check = time.monotonic() + POLL_S
        try:
            while True:
                now = time.monotonic()
                if now > ticket.deadline and (ticket.started is None or now > ticket.deadline + CUT_GRACE_S):
                    yield Outcome(error=timeout_error(ticket))
                    return
                if request is not None and now >= next_check:
                    if await request.is_disconnected():
                        return
                    next_check = now + POLL_S
                try:
                    event = await asyncio.wait_for(ticket.events.get(), POLL_S)
                except TimeoutError:
                    continue
                yield event
                if isinstance(event, Outcome):
                    return
        finally:
            self.scheduler.withdraw(ticket)


def create_app(engine: Engine, config: ServeConfig | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`. Its worker thread runs while the app's lifespan does."""
    service = Service(engine, config or ServeConfig())
    app = FastAPI(
        title="draftverify", summary="Lossless draft-then-verify decoding behind the OpenAI API", lifespan=lifespan
    )
    app.state.service = service  # what the lifespan and every route below read
    access.guard(app, service.config)  # the API key check, inside the request counter
    app.add_middleware(CountRequests, metrics=service.metrics)
    access.allow_origins(app, service.config)  # CORS, outermost
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(routes)
    app.include_router(llama_routes)
    app.include_router(page_routes)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Run the app's scheduler worker while the app serves; on the way out stop it and save the pools."""
    service: Service = app.state.service
    service.start()
    try:
        yield
    finally:
        await asyncio.to_thread(service.close)


async def api_error(request: Request, exc: ApiError):
    """An ApiError as OpenAI's error body with its status and headers (e.g. Retry-After)."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(request: Request, exc: HTTPException):
    """Starlette's own errors (unknown route, wrong method) in the same OpenAI error body."""
    message = f"{exc.detail}: {request.method} {request.url.path}"
    code = "not_found" if exc.status_code == 404 else None
    return await api_error(request, ApiError(exc.status_code, message, code=code, headers=exc.headers))


routes = APIRouter()  # the app's routes; each reads the Service from request.app.state


async def generate(request: Request, kind: str):
    """One completion request of `kind` ("completion" or "chat"): its choices queued, then streamed or awaited."""
    service: Service = request.app.state.service
    req = parse_request(await read_body(request, service.config.max_body_bytes), kind, service.config.strict)
    tools = tool_plan(req, service.engine) if kind == "chat" else None
    job = service.job(req, kind, tools)
    tickets = [Ticket(one, service.config.timeout_s) for one in choice_jobs(job, req.n)]
    service.scheduler.submit(*tickets)
    reply, tokenizer = Reply(kind, service.model_name, tools), service.engine.target.tokenizer
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = keep_alive(
            stream_choices(reply, tickets, service.follow, tokenizer, include_usage), service.config.keep_alive_s
        )
        return TicketStream(events, tickets, service.scheduler)
    ended = await outcomes(tickets, lambda ticket: service.follow(ticket, request))
    if any(outcome is None for outcome in ended):  # the client is gone
        for ticket in tickets:
            service.scheduler.withdraw(ticket)
        return Response(status_code=499)
    return JSONResponse(whole_response(reply, tokenizer, tickets, ended))


@routes.post("/v1/completions")
async def completions(request: Request):
    """OpenAI text completion (raw prompt, no chat template)."""
    return await generate(request, "completion")


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request):
    """OpenAI chat completion: the messages go through the model's chat template."""
    return await generate(request, "chat")


@routes.get("/v1/models")
async def models(request: Request):
    service: Service = request.app.state.service
    methods = list(service.methods)
    return {
        "object": "list",
        "data": [
            {
                "id": service.model_name,
                "object": "model",
                "created": service.created,
                "owned_by": "draftverify",
                "methods": methods,
                "default_method": methods[0],
            }
        ],
    }


@routes.get("/health")
async def health(request: Request):
    service: Service = request.app.state.service
    closing = service.scheduler.closing
    body = {
        "status": "shutting_down" if closing else "ok",
        "model": service.model_name,
        "methods": list(service.methods),
        "queue_depth": service.scheduler.depth,
        "queue_capacity": service.config.max_queue,
        "busy": service.scheduler.busy,
        "running": service.scheduler.running,
        "max_batch": service.config.max_batch,
    }
    return JSONResponse(body, status_code=503 if closing else 200)


@routes.get("/metrics")
async def metrics(request: Request):
    service: Service = request.app.state.service
    text = service.metrics.render(service.scheduler.depth, service.config.max_queue, service.scheduler.busy)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


class TicketStream(StreamingResponse):
    """Server-sent events that withdraw their tickets (a request's choices) when the response ends, however it
    ends (even if the client left before the first event was sent)."""

    def __init__(self, events, tickets: list[Ticket], scheduler: Scheduler):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.tickets, self.scheduler = tickets, scheduler

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for ticket in self.tickets:
                self.scheduler.withdraw(ticket)
