"""`n` > 1: several choices of one request, each decoded as a member of the batch.

A request with `n` choices becomes `n` tickets (`choice_jobs`) that join the scheduler's batch like `n`
requests would: they decode together, one target forward per step for all of them (and for the other
requests running). Each choice is exact as any request is, under this seed rule: choice `i` of a request
with `seed` s decodes with seed s + i (so choice 0 is the request's `n = 1` answer); without a seed every
choice draws from fresh randomness; greedily (temperature 0) every choice is the one greedy answer. A
seeded sampled choice is token-equal to the same request decoded alone when its draft lengths are the
same (autoregressive, a constant draft length): the cost policies price a draft by the rows it adds to
the batch's forward, and a different draft length draws the seed's random numbers differently (still
exactly distributed as the target's samples). The line takes all `n` tickets at once or none (`Scheduler.submit`:
429 when they do not fit), so they join the batch together when it has room.

Non-streamed: the choices come back in index order, `usage` counts the prompt once and every choice's
tokens. Streamed: each choice's chunks carry its `index` and arrive as they are accepted (interleaved); an
error in any choice ends the stream with its error event, as for `n = 1`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from draftverify.serve.extras import logprobs_object
from draftverify.serve.protocol import FINISH_REASONS, ApiError, Reply, TextStream, sse, stats_object, usage
from draftverify.serve.provenance import Marks
from draftverify.serve.scheduler import Chunk, Job, Outcome, Ticket
from draftverify.serve.tools import stream_chunks


def choice_jobs(job: Job, n: int) -> list[Job]:
    """The `n` choices' jobs: choice i with seed `job.seed + i` (None stays None: unseeded)."""
    seeds = [None if job.seed is None else job.seed + i for i in range(n)]
    return [job if i == 0 else dataclasses.replace(job, seed=seeds[i]) for i in range(n)]


async def outcomes(tickets: list[Ticket], follow: Callable) -> list[Outcome | None]:
    """Each ticket's last event (its Outcome), followed at once; None for a ticket whose client left."""

    async def last(ticket: Ticket) -> Outcome | None:
        outcome = None
        async for event in follow(ticket):
            outcome = event if isinstance(event, Outcome) else None
        return outcome

    return list(await asyncio.gather(*(last(t) for t in tickets)))


def whole_response(reply: Reply, tokenizer, tickets: list[Ticket], ended: list[Outcome]) -> dict:
    """The non-streamed body of finished choices (raises the first choice's error, if any has one)."""
    for outcome in ended:
        if outcome.error is not None:
            raise outcome.error
    choices, stats = [], []
    for i, (ticket, outcome) in enumerate(zip(tickets, ended)):
        result = outcome.result
        logprobs = logprobs_object(reply.kind, tokenizer, result.logprobs)
        choices.append(reply.choice(result.text, FINISH_REASONS[result.stats.finish_reason], logprobs, index=i))
        stats.append(stats_object(result.stats, ticket.job.method, ticket.started - ticket.submitted))
    if len(choices) > 1:
        for choice, own in zip(choices, stats):
            choice["draftverify"] = {**own, "timings": dict(own["timings"])}
    prompt = len(ended[0].result.prompt_tokens)
    return reply.whole_choices(choices, usage(prompt, sum(len(o.result.tokens) for o in ended)), stats[0])


async def stream_choices(
    reply: Reply, tickets: list[Ticket], follow: Callable, tokenizer, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of every choice, each chunk as soon as its choice accepts it, then `[DONE]`."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, ticket: Ticket) -> None:
        try:
            async for event in one_choice(reply, index, ticket, follow, tokenizer):
                await queue.put(event)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, t)) for i, t in enumerate(tickets)]
    results, running = [], len(tasks)
    try:
        while running:
            event = await queue.get()
            if event is None:
                running -= 1
            elif isinstance(event, ApiError):
                yield sse(event.body())
                break
            elif isinstance(event, tuple):  # a choice's result and stats, for the usage chunk
                results.append(event)
            else:
                yield sse(event)
        else:
            if include_usage and results:
                completion = sum(len(result.tokens) for result, _ in results)
                first = min(results, key=lambda pair: pair[1]["index"])
                prompt = len(first[0].prompt_tokens)
                yield sse(reply.usage_chunk(usage(prompt, completion), first[1]["stats"]))
    finally:
        for task in tasks:
            task.cancel()
    yield sse("[DONE]")


async def one_choice(reply: Reply, index: int, ticket: Ticket, follow: Callable, tokenizer) -> AsyncIterator:
    """One choice's chunks (dicts), then (its result, {index, stats}), or an ApiError."""
    text = TextStream(tokenizer, list(ticket.job.stop))
    calls = reply.tools.stream() if reply.tools is not None else None  # the text as content and tool calls
    marks = Marks(tokenizer) if ticket.job.provenance else None
    if reply.kind == "chat":
        yield reply.chunk(first=True, index=index)
    async for event in follow(ticket):
        if isinstance(event, Chunk):
            offset = len(text.sent)
            delta = text.push(event.tokens)
            logprobs = logprobs_object(reply.kind, tokenizer, event.logprobs, offset)
            if marks is not None:
                marks.push(event.tokens, event.provenance)
            if calls is not None:  # a tool call's chunks carry no provenance
                for chunk in stream_chunks(reply, index, calls.push(delta), logprobs):
                    yield chunk
            elif delta or logprobs is not None:
                yield reply.chunk(delta, logprobs=logprobs, index=index, **(marks.take(delta) if marks else {}))
        elif event.error is not None:
            yield event.error
        else:
            result = event.result
            tail = text.finish(result.text)
            if calls is not None:
                for chunk in stream_chunks(reply, index, calls.push(tail, final=True)):
                    yield chunk
            elif tail:
                yield reply.chunk(tail, index=index, **(marks.take(tail) if marks else {}))
            stats = stats_object(result.stats, ticket.job.method, ticket.started - ticket.submitted)
            finish = FINISH_REASONS[result.stats.finish_reason]
            finish = calls.finish_reason(finish) if calls is not None else finish
            yield reply.chunk(finish=finish, index=index, draftverify=stats, timings=stats.pop("timings"))
            yield (result, {"index": index, "stats": stats})
