"""Who may call the server: API keys, CORS origins, TLS files, the server-wide token cap.

With keys set (`--api-key`, `--api-key-file`), every request must carry `Authorization: Bearer <key>`,
as OpenAI clients send their `api_key`; any other request is answered 401 in OpenAI's error format
before its body is read. `GET /health` stays open, so that load balancers and orchestrators can
probe a replica without a secret; every other route, /metrics and unknown paths included, needs a
key. Keys are compared with `hmac.compare_digest`, against every configured key, so the time taken
says nothing about how much of a key was right. CORS (`--cors-origin`) wraps everything, so a
browser's preflight (OPTIONS, sent without credentials) is answered before the key check and a 401
still carries the CORS headers the browser needs to read it.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from draftverify.errors import require

OPEN_ROUTES = ("/health", "/")  # answered without a key (the web page holds no data: it asks the user for a key)


def read_keys(keys: list[str] | tuple[str, ...], key_file: Path | None = None) -> tuple[str, ...]:
    """The keys given on the command line plus those of `key_file`: one a line, blank lines and `#` comments
    skipped."""
    out = [k.strip() for k in keys]
    if key_file is not None:
        require(Path(key_file).is_file(), f"--api-key-file {key_file} does not exist: give a file of keys, one a line")
        lines = Path(key_file).read_text().splitlines()
        out += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        require(len(out) > len(keys), f"--api-key-file {key_file} holds no key: write one key a line")
    return tuple(out)


def config_fields(
    api_key: list[str] | None,
    api_key_file: Path | None,
    cors_origin: list[str] | None,
    max_tokens: int | None,
    strict: bool,
    chat_template: Path | None,
    keep_alive_s: float,
) -> dict:
    """ServeConfig's access and compatibility fields from `draftverify serve`'s options (the files read)."""
    require(
        chat_template is None or Path(chat_template).is_file(),
        f"--chat-template {chat_template} does not exist: give a Jinja template file",
    )
    return {
        "api_keys": read_keys(api_key or [], api_key_file),
        "cors_origins": tuple(cors_origin or ()),
        "max_tokens": max_tokens,
        "strict": strict,
        "chat_template": Path(chat_template).read_text() if chat_template else None,
        "keep_alive_s": keep_alive_s,
    }


def check_access(config) -> None:
    """ServeConfig's access and limit fields, each refused in one line."""
    for key in config.api_keys:
        require(key and not any(c.isspace() for c in key), "an API key is empty or holds whitespace: give one token")
    require(
        config.max_tokens is None or config.max_tokens >= 1,
        f"max_tokens={config.max_tokens} must be at least 1 (or unset: no cap)",
    )
    require(config.keep_alive_s >= 0, f"keep_alive={config.keep_alive_s} must be at least 0 (seconds; 0: none)")
    for origin in config.cors_origins:
        require(
            origin == "*" or origin.startswith(("http://", "https://")),
            f"CORS origin {origin!r} is not an origin: give e.g. https://example.com, or *",
        )


def check_tls(certfile: Path | None, keyfile: Path | None) -> None:
    """Both TLS files or neither, and each one present."""
    require((certfile is None) == (keyfile is None), "TLS needs both --ssl-certfile and --ssl-keyfile: give both")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        require(path is None or Path(path).is_file(), f"{flag} {path} does not exist: give a PEM file")


def capped(asked: int | None, cap: int | None) -> int | None:
    """A request's max_tokens under the server's cap: larger asks are clamped to it (the answer then stops with
    finish_reason "length" at the cap, as any answer that runs out of tokens does)."""
    return asked if asked is None or cap is None else min(asked, cap)


def guard(app, config) -> None:
    """Install the key check (when keys are set); call it before the request counter, so 401s are counted."""
    if config.api_keys:
        app.add_middleware(RequireKey, keys=config.api_keys)


def allow_origins(app, config) -> None:
    """Install CORS for the configured origins, outside every other middleware (see the module's docstring)."""
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )


def key_matches(header: str, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header carries one of `keys`; every key is compared, in constant time each."""
    scheme, _, given = header.partition(" ")
    given_bytes = given.strip().encode()
    hits = [hmac.compare_digest(given_bytes, key.encode()) for key in keys]
    return scheme.lower() == "bearer" and any(hits)


class RequireKey:
    """ASGI middleware: 401 for an HTTP request without a valid `Authorization: Bearer` key (OPEN_ROUTES pass)."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if key_matches(headers.get(b"authorization", b"").decode("latin-1"), self.keys):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        from draftverify.serve.api_error import ApiError

        missing = b"authorization" not in headers
        error = ApiError(
            401,
            "no API key: send the header 'Authorization: Bearer <key>' (the openai client's api_key)"
            if missing
            else "the API key is wrong: send one of the server's keys as 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
