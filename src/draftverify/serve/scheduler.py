"""The model's queue: continuous batching over a bounded line of waiting requests.

One worker loop (on the main thread under `draftverify serve`, `Server.run_on_main`; on a thread
of its own for an app embedded elsewhere) runs up to `max_batch` requests together (`draftverify.batch`: one
stacked target forward per step, each request in its own engine slot with caches of its own);
requests join the running batch between steps as slots free up, and wait in a bounded FIFO line
until then (429 with Retry-After when the line is full). A request handler (on the asyncio
event loop) talks to its request through a `Ticket`: the worker posts each accepted chunk of
tokens and then the outcome; the handler withdraws the ticket when its client goes away.
Cancellation is checked at every accepted chunk (the `on_tokens` hook) and before every step, so
a disconnected client, a request past its deadline or a shutdown past its grace period frees its
slot within one step. Whatever a request raises is that request's error (400 for a bad setting,
500 otherwise); the others in the batch go on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from draftverify.batch import Batch, Member
from draftverify.costs import curve
from draftverify.drafters.feature import TREE_WIDTHS
from draftverify.engine import Engine, Result
from draftverify.errors import DraftVerifyError
from draftverify.serve.metrics import Metrics
from draftverify.serve.protocol import ApiError
from draftverify.serve.provenance import tally

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
    knobs: dict = field(default_factory=dict)  # penalties, logit_bias, min_p, response_format, logprobs (extras.knobs)
    provenance: bool = False  # the chunks say who drafted each token (serve/provenance.py)


@dataclass
class Chunk:
    tokens: list[int]  # accepted tokens, in order
    logprobs: list | None = None  # logits.Logprob per token, when the request asked for them
    provenance: dict | None = None  # who drafted each token and the running counts (`provenance.tally`), if asked


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
    slot: int = -1  # the engine's batch slot it runs in

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
    """A bounded FIFO line of tickets and the worker thread that runs them, up to `max_batch` at once."""

    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        metrics: Metrics,
        max_batch: int = 8,
        prompt_part: int = 0,
        max_gap_s: float = 0.0,
    ):
        """`prompt_part`, `max_gap_s`: how a long prompt is fed beside decoding requests (`batch.Batch`); under a gap
        budget the target's cost curve, which sizes the parts, is measured now, before a client waits for it (the
        curve `auto` reads: none more where auto is loaded)."""
        if prompt_part and max_gap_s and engine.target_runner.rows_alone:
            curve(engine.target_runner, widths=TREE_WIDTHS)
        self.engine, self.max_queue, self.metrics, self.max_batch = engine, max_queue, metrics, max_batch
        self._line: deque[Ticket] = deque()
        self._cond = threading.Condition()
        self._batch = Batch(prompt_part, max_gap_s)
        self._joining = 0
        self._closing = False
        self._cancel_at = math.inf  # once draining: when the running generations are cut short
        self._mean_s = 1.0  # running mean of generation time, for Retry-After
        self._thread = threading.Thread(target=self._work, name="draftverify-worker", daemon=True)
        self.own_thread = True  # False: the caller runs `work` itself (on the main thread: `Server.run_on_main`)

    @property
    def depth(self) -> int:
        return len(self._line)

    @property
    def running(self) -> int:
        """Requests the worker has taken: in the batch, or joining it."""
        return len(self._batch) + self._joining

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        if self.own_thread:
            self._thread.start()

    def work(self, alive) -> None:
        """Run the worker loop on the calling thread until the server has drained it, or `alive()` turns False.

        Why the main thread: PyTorch's OpenMP parallel regions started from another thread pay tens of
        microseconds each, and a stacked forward is hundreds of small attention ops, so a decode step runs
        markedly slower on a worker thread (docs/serve.md)."""
        self._work(alive)

    def submit(self, *tickets: Ticket) -> None:
        """Put the tickets in line (one request's choices: all of them or none, so they join the batch together), or
        refuse them: 429 when the line has no room for them all, 503 when shutting down."""
        with self._cond:
            if self._closing:
                raise ApiError(503, "the server is shutting down: retry on another replica", code="shutting_down")
            if len(self._line) + len(tickets) > self.max_queue:
                wait = max(1, math.ceil(self._mean_s * (len(self._line) + len(tickets)) / self.max_batch))
                raise ApiError(
                    429,
                    f"the queue is full ({len(self._line)} of {self.max_queue} requests waiting, {len(tickets)} more "
                    f"asked): retry in {wait}s" + (", or ask for fewer choices (n)" if len(tickets) > 1 else ""),
                    code="queue_full",
                    headers={"Retry-After": str(wait)},
                )
            self._line.extend(tickets)
            self._cond.notify()

    def withdraw(self, ticket: Ticket) -> None:
        """The handler no longer listens: leave the line, or have the worker drop it before its next step."""
        with self._cond:
            ticket.withdrawn = True
            if ticket in self._line:
                self._line.remove(ticket)

    def drain(self, grace_s: float) -> None:
        """Take no more requests; refuse those waiting (503); cut the running ones after `grace_s`."""
        with self._cond:
            self._closing = True
            self._cancel_at = min(self._cancel_at, time.monotonic() + grace_s)
            waiting, self._line = list(self._line), deque()
            self._cond.notify_all()
        for ticket in waiting:
            ticket.post(
                Outcome(
                    error=ApiError(503, "the server is shutting down: retry on another replica", code="shutting_down")
                )
            )

    def stop(self, timeout_s: float) -> bool:
        """Drain at once and wait for the worker to finish. False if it is still running."""
        self.drain(0.0)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the worker thread ---------------------------------------------------------------

    def _work(self, alive=None) -> None:
        while True:
            with self._cond:
                while not self._line and not self._batch.members and not self._closing:
                    if alive is not None and not alive():
                        return
                    self._cond.wait(None if alive is None else 0.5)
                if not self._line and not self._batch.members:
                    return
                joining = []
                while self._line and len(self._batch) + len(joining) < self.max_batch:
                    joining.append(self._line.popleft())
                self._joining = len(joining)
            for ticket in joining:
                self._join(ticket)
                self._joining -= 1
            for member in list(self._batch.members):  # a client gone, a deadline passed, a shutdown: free the slot now
                ticket = member.tag
                ticket.cut = ticket.cut or self._cut_reason(ticket)
                if ticket.cut is not None:
                    self._batch.drop(member)
                    self._end(member)
            for member in self._batch.step():
                self._end(member)

    def _free_slot(self) -> int:
        taken = {m.tag.slot for m in self._batch.members}
        return next(i for i in range(self.max_batch) if i not in taken)

    def _join(self, ticket: Ticket) -> None:
        """Start the ticket's job in a free slot of the batch (its prefill rides in the next step)."""
        ticket.started = time.monotonic()
        if ticket.started > ticket.deadline:
            return ticket.post(Outcome(error=timeout_error(ticket)))
        job = ticket.job

        sessions = []  # the session, once made: its processor holds the logprobs of the tokens

        def on_tokens(tokens: list[int]) -> bool:
            marks = tally(sessions[0], len(tokens)) if job.provenance else None
            ticket.post(Chunk(tokens, chunk_logprobs(sessions[0], len(tokens)), marks))
            ticket.cut = self._cut_reason(ticket)
            return ticket.cut is None

        ticket.slot = self._free_slot()
        try:
            method, session = self.engine.request(
                job.prompt,
                method=job.name,
                preset=job.preset,
                max_new_tokens=job.max_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                top_k=job.top_k,
                seed=job.seed,
                stop=list(job.stop),
                on_tokens=on_tokens,
                slot=ticket.slot,
                **job.options,
                **job.knobs,
            )
            session.provenance = job.provenance
            sessions.append(session)
        except Exception as exc:  # this request's error; keep serving
            return ticket.post(Outcome(error=failure(exc)))
        session.stats.start()
        self._batch.add(session, method.target, method.rounds(session), tag=ticket)

    def _end(self, member: Member) -> None:
        """Post the outcome of a request that left the batch."""
        ticket, session = member.tag, member.session
        self.engine.finish(session)
        wall = time.monotonic() - ticket.started
        if member.error is not None:
            error = failure(member.error)
            if error.status == 500:
                self.metrics.generation(ticket.job.method, None, wall)
            return ticket.post(Outcome(error=error))
        self._mean_s += 0.2 * (wall - self._mean_s)
        self.metrics.generation(ticket.job.method, session.stats, wall, queue_s=ticket.started - ticket.submitted)
        if ticket.cut == "timeout":
            return ticket.post(Outcome(error=timeout_error(ticket)))
        if ticket.cut == "shutdown":
            return ticket.post(
                Outcome(
                    error=ApiError(
                        503, "the server shut down during this request: retry on another replica", code="shutting_down"
                    )
                )
            )
        ticket.post(Outcome(result=self.engine.result(session)))

    def _cut_reason(self, ticket: Ticket) -> str | None:
        now = time.monotonic()
        if ticket.withdrawn:
            return "withdrawn"
        if now > ticket.deadline:
            return "timeout"
        if now > self._cancel_at:
            return "shutdown"
        return None


def chunk_logprobs(session, n: int) -> list | None:
    """The logprobs of the session's last `n` emitted tokens, if it records them."""
    processor = session.processor
    if processor is None or processor.top_logprobs is None:
        return None
    end = len(session.output)
    return processor.logprobs[end - n : end]


def failure(exc: BaseException) -> ApiError:
    """A request's error as its client gets it: a setting the request's validation let through (400), else a bug
    or a device error such as running out of memory (500, logged)."""
    if isinstance(exc, DraftVerifyError):
        return ApiError(400, str(exc), code="invalid_request")
    log.error("generation failed", exc_info=exc)
    return ApiError(
        500, f"generation failed: {type(exc).__name__}: {str(exc).partition(chr(10))[0]}", code="generation_failed"
    )


def timeout_error(ticket: Ticket) -> ApiError:
    return ApiError(
        504,
        f"the request took longer than the server's timeout of {ticket.timeout_s:g}s: "
        "ask for fewer tokens or retry later",
        code="timeout",
    )
