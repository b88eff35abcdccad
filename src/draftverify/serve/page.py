"""The web page at `/`: a chat that streams replies and colours each token by who drafted it.

One static HTML file (`serve/assets/index.html`, plain JavaScript, no build step, nothing fetched from elsewhere)
that talks to the server's own API: `GET /v1/models` for the methods to pick from, `POST /v1/chat/completions`
with `stream: true` and `"draftverify": {"provenance": true}` (serve/provenance.py) for the reply. `/` is open
like /health, since the page holds no data; with `--api-key` the page asks for a key and sends it as a Bearer
token with its API calls. docs/serve.md: The web page.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

routes = APIRouter()


@cache
def page() -> str:
    return resources.files("draftverify.serve").joinpath("assets/index.html").read_text(encoding="utf-8")


@routes.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index():
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})
