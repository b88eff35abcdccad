"""SSE keep-alive: a comment line while a stream has nothing to send.

A streamed request may wait in the queue, or between chunks behind a long prefill, longer than a proxy's
or client's idle timeout. `keep_alive` passes a stream's events through unchanged and, whenever
`interval_s` goes by without one, sends `: keep-alive` followed by a blank line: an SSE comment, which
every SSE client skips (OpenAI's clients included), so the text and the events a client sees are
unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

COMMENT = ": keep-alive\n\n"


async def keep_alive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`events`, with COMMENT after every `interval_s` seconds of silence (0: none, the events as they are)."""
    if not interval_s:
        async for event in events:
            yield event
        return
    source = aiter(events)
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield COMMENT
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(source))
    finally:  # the response ended (or the client left): stop the source, then let it clean up (withdraw tickets)
        if not pending.done():
            pending.cancel()
            await asyncio.wait({pending})
        if not pending.cancelled():
            pending.exception()  # retrieved: StopAsyncIteration or the source's own error, already ended
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):
                await aclose()
