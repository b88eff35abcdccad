"""HTTP plumbing under the routes: the body size limit and the per-route request counter."""

from __future__ import annotations

from fastapi import Request

from draftverify.serve.metrics import Metrics
from draftverify.serve.protocol import ApiError

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/props",
)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (before reading it all)."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the body is larger than {limit} bytes: send a shorter prompt", code="body_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    return bytes(body)


class CountRequests:
    """ASGI middleware: count answered requests by route and status code (499: client gone)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            status.setdefault("code", 500)
            raise
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.request(route, status.get("code", 499))
