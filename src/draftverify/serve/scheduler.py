"""The model's queue: one generation at a time, a bounded line of waiting requests.

An `Engine` decodes one request at a time (its methods share the KV caches), so requests
wait in a bounded FIFO line and a single worker thread runs them in turn. A request handler
(on the asyncio event loop) talks to its request through a `Ticket`: the worker posts each
accepted chunk of tokens and then the outcome; the handler withdraws the ticket when its
client goes away. Cancellation is checked at every accepted chunk (`Engine.generate`'s
`on_tokens` hook), so a disconnected client, a request past its deadline or a shutdown past
its grace period frees the model within one decoding step. Whatever a generation raises is
that request's 500; every method starts from a fresh cache, so the next request is unharmed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from draftverify.engine import Engine, Result
from draftverify.errors import DraftVerifyError
from draftverify.serve.metrics import Metrics
from draftverify.serve.protocol import ApiError

log = logging.getLogger("draftverify.serve")


@dataclass(frozen=True)
class Job:
    """What to generate, validated: the arguments of `Engine.generate`."""

    prompt: list[int]
    method: str  # the method spec as the server was started with it
    name: str  # method name, preset and options: how the engine finds the method instance
    preset: str | None
    options: dict
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]


@dataclass
class Chunk:
    tokens: list[int]  # accepted tokens, in order


@dataclass
class Outcome:
    result: Result | None = None
    error: ApiError | None = None


@dataclass(eq=False)
class Ticket:
    """One request on its way through the scheduler. Create it on the event loop."""

    job: Job
    timeout_s: float
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the worker took it
    withdrawn: bool = False  # the handler stopped listening (client gone, or it gave up waiting)
    cut: str | None = None  # why the worker cancelled the generation: timeout, shutdown, withdrawn

    def __post_init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Chunk | Outcome] = asyncio.Queue()
        self.deadline = self.submitted + self.timeout_s

    def post(self, event: Chunk | Outcome) -> None:
        """Hand an event to the handler (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Scheduler:
    """A bounded FIFO line of tickets and the worker thread that runs them one at a time."""

    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._line: deque[Ticket] = deque()
        self._cond = threading.Condition()
        self._running: Ticket | None = None
        self._closing = False
        self._cancel_at = math.inf  # once draining: when the running generation is cut short
        self._mean_s = 1.0  # running mean of generation time, for Retry-After
        self._thread = threading.Thread(target=self._work, name="draftverify-worker", daemon=True)

    @property
    def depth(self) -> int:
        return len(self._line)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        """Put the ticket in line, or refuse it: 429 when the line is full, 503 when shutting down."""
        with self._cond:
            if self._closing:
                raise ApiError(503, "the server is shutting down: retry on another replica", code="shutting_down")
            if len(self._line) >= self.max_queue:
                wait = max(1, math.ceil(self._mean_s * (len(self._line) + 1)))
                raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting): retry in {wait}s", code="queue_full", headers={"Retry-After": str(wait)})
            self._line.append(ticket)
            self._cond.notify()

    def withdraw(self, ticket: Ticket) -> None:
        """The handler no longer listens: leave the line, or have the worker stop at the next chunk."""
        with self._cond:
            ticket.withdrawn = True
            if ticket in self._line:
                self._line.remove(ticket)

    def drain(self, grace_s: float) -> None:
        """Take no more requests; refuse those waiting (503); cut the running one after `grace_s`."""
        with self._cond:
            self._closing = True
            self._cancel_at = min(self._cancel_at, time.monotonic() + grace_s)
            waiting, self._line = list(self._line), deque()
            self._cond.notify_all()
        for ticket in waiting:
            ticket.post(Outcome(error=ApiError(503, "the server is shutting down: retry on another replica", code="shutting_down")))

    def stop(self, timeout_s: float) -> bool:
        """Drain at once and wait for the worker to finish. False if it is still running."""
        self.drain(0.0)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the worker thread ---------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._line and not self._closing:
                    self._cond.wait()
                if not self._line:
                    return
                ticket = self._running = self._line.popleft()
            ticket.started = time.monotonic()
            try:
                ticket.post(self._run(ticket))
            except DraftVerifyError as exc:  # a setting the request's validation let through
                ticket.post(Outcome(error=ApiError(400, str(exc), code="invalid_request")))
            except Exception as exc:  # a bug or a device error (out of memory): fail this request, keep serving
                log.exception("generation failed")
                ticket.post(Outcome(error=ApiError(500, f"generation failed: {type(exc).__name__}: {str(exc).partition(chr(10))[0]}", code="generation_failed")))
                self.metrics.generation(ticket.job.method, None, time.monotonic() - ticket.started)
            finally:
                self._running = None

    def _run(self, ticket: Ticket) -> Outcome:
        """Generate the ticket's job, posting each accepted chunk; the outcome to post last."""
        if ticket.started > ticket.deadline:
            return Outcome(error=timeout_error(ticket))
        job = ticket.job

        def on_tokens(tokens: list[int]) -> bool:
            ticket.post(Chunk(tokens))
            ticket.cut = self._cut_reason(ticket)
            return ticket.cut is None

        result = self.engine.generate(
            job.prompt, method=job.name, preset=job.preset, max_new_tokens=job.max_tokens, temperature=job.temperature,
            top_p=job.top_p, top_k=job.top_k, seed=job.seed, stop=list(job.stop), on_tokens=on_tokens, **job.options,
        )
        wall = time.monotonic() - ticket.started
        self._mean_s += 0.2 * (wall - self._mean_s)
        self.metrics.generation(job.method, result.stats, wall, queue_s=ticket.started - ticket.submitted)
        if ticket.cut == "timeout":
            return Outcome(error=timeout_error(ticket))
        if ticket.cut == "shutdown":
            return Outcome(error=ApiError(503, "the server shut down during this request: retry on another replica", code="shutting_down"))
        return Outcome(result=result)

    def _cut_reason(self, ticket: Ticket) -> str | None:
        now = time.monotonic()
        if ticket.withdrawn:
            return "withdrawn"
        if now > ticket.deadline:
            return "timeout"
        if now > self._cancel_at:
            return "shutdown"
        return None


def timeout_error(ticket: Ticket) -> ApiError:
    return ApiError(504, f"the request took longer than the server's timeout of {ticket.timeout_s:g}s: ask for fewer tokens or retry later", code="timeout")
