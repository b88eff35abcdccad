"""`draftverify load`: a bounded load generator for the OpenAI-compatible endpoint, on loopback only.

For each method and each concurrency c, `requests` chat requests (prompts from the shared prompt
sets, greedy, streamed) are sent by c clients at once, each client sending its next request as
soon as its last one ended. Per request it records the time to the first text (TTFT), the whole
latency, the completion tokens (the server's usage) and the text; per run the aggregate tokens/s
(all completion tokens / the run's wall time), latency and TTFT percentiles and errors. Greedy
outputs are compared with the same prompt's output at the lowest concurrency of the same method
and with the first method's, so a server that changes outputs under load is caught. With a JSON
`response_format` (`--response-format FILE`), each output is also checked to parse and validate
(`load_format`), and a run counts the invalid ones. Before the runs each method answers one short untimed
request, so what a server does once is charged to no run.

`--spawn` starts `draftverify serve` itself on a free loopback port with the methods asked for
and stops it afterwards. Writes results.json, report.md and tokens_per_s.png (atomically);
the command line is `load_cli`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

from draftverify.bench.metrics import percentile
from draftverify.errors import require
from draftverify.serve.load_format import output_valid

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SPAWN_WAIT_S = 600.0  # loading the model (and, the first time, converting it and compiling kernels) may take minutes


@dataclass
class Call:
    """One request as the client saw it."""

    prompt: int  # index into the prompt list
    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0
    text: str = ""
    error: str = ""
    valid: bool | None = None  # the text parses / validates against the JSON format sent; None: none was sent
    gap_max_s: float | None = None  # the longest wait between two pieces of text (a stream that stalled)
    gaps: list[float] = field(default_factory=list, repr=False)  # every wait between two pieces of text


@dataclass
class Run:
    method: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    tokens_per_s: float
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    gap_p99_s: float | None = None  # over every wait between two pieces of text of every request of the run
    gap_max_s: float | None = None
    mismatches: int = 0  # greedy outputs that differ from the reference output of the same prompt
    invalid: int | None = None  # outputs that do not parse / validate; None when no JSON format was sent
    calls: list[Call] = field(default_factory=list)


def check_loopback(url: str) -> str:
    """The base URL (…/v1) if it points at this machine; a one-line error otherwise."""
    parsed = urlparse(url)
    require(
        parsed.scheme in ("http", "https") and parsed.hostname is not None,
        f"--url {url!r} is not an http URL: give e.g. http://127.0.0.1:8000/v1",
    )
    require(
        parsed.hostname in LOOPBACK,
        f"--url {url!r} is not on loopback: the load tool only sends traffic to 127.0.0.1 / localhost",
    )
    return url.rstrip("/")


@dataclass(frozen=True)
class Ask:
    """What every request of a load run carries besides its method and prompt."""

    max_tokens: int
    timeout_s: float
    response_format: dict | None = None  # an OpenAI response_format object, sent as is
    system: str | None = None  # a system message before each prompt

    def body(self, model: str, method: str, prompt: str) -> dict:
        """The chat request: greedy, streamed, with usage in the last chunk."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        body = {
            "model": model,
            "method": method,
            "messages": messages + [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.response_format is not None:
            body["response_format"] = self.response_format
        return body


async def one_call(client, base: str, model: str, method: str, index: int, prompt: str, ask: Ask) -> Call:
    """Send one streamed greedy chat request; time the first text and the whole reply."""
    body = ask.body(model, method, prompt)
    start = time.perf_counter()
    call = Call(index, ok=False)
    try:
        async with client.stream("POST", f"{base}/chat/completions", json=body, timeout=ask.timeout_s) as response:
            if response.status_code != 200:
                call.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return call
            parts, last = [], 0.0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    call.error = str(event["error"].get("message", event["error"]))[:200]
                    return call
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        now = time.perf_counter() - start
                        if call.ttft_s is None:
                            call.ttft_s = now
                        else:
                            call.gaps.append(now - last)
                        last = now
                        parts.append(text)
                if event.get("usage"):
                    call.tokens = event["usage"]["completion_tokens"]
            call.text, call.ok = "".join(parts), True
            call.gap_max_s = max(call.gaps, default=None)
    except Exception as exc:  # a refused connection, a timeout, a broken stream: this request's error
        call.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        call.latency_s = time.perf_counter() - start
    return call


async def run_load(
    base: str,
    model: str,
    method: str,
    prompts: list[str],
    concurrency: int,
    requests: int,
    ask: Ask,
    deadline: float,
) -> Run:
    """`requests` requests (prompts in turn) from `concurrency` clients; none starts after `deadline` (monotonic)."""
    import httpx

    order = list(range(requests))
    calls: list[Call] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def client_loop() -> None:
            while order and time.monotonic() < deadline:
                i = order.pop(0)
                calls.append(
                    await one_call(client, base, model, method, i % len(prompts), prompts[i % len(prompts)], ask)
                )

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    good = [c for c in calls if c.ok]
    for c in good:  # checked after the clock stopped: the check is the tool's work, not the server's
        c.valid = output_valid(c.text, ask.response_format)
    gaps = [g for c in good for g in c.gaps]
    return Run(
        method=method,
        concurrency=concurrency,
        requests=len(calls),
        errors=len(calls) - len(good),
        wall_s=wall,
        tokens_per_s=sum(c.tokens for c in good) / wall if wall > 0 else 0.0,
        latency_p50_s=percentile([c.latency_s for c in good], 50),
        latency_p99_s=percentile([c.latency_s for c in good], 99),
        ttft_p50_s=percentile([c.ttft_s for c in good if c.ttft_s is not None], 50),
        ttft_p99_s=percentile([c.ttft_s for c in good if c.ttft_s is not None], 99),
        gap_p99_s=percentile(gaps, 99),
        gap_max_s=max(gaps, default=None),
        invalid=None if all(c.valid is None for c in good) else sum(1 for c in good if c.valid is False),
        calls=sorted(calls, key=lambda c: c.prompt),
    )


def without_gaps(run: dict) -> dict:
    """A run as results.json holds it: each call's longest gap, not every gap (the run's percentiles have them)."""
    for call in run["calls"]:
        call.pop("gaps")
    return run


def count_mismatches(runs: list[Run]) -> None:
    """Per run, the greedy outputs that differ from the reference of the same prompt: the same method's
    lowest-concurrency run, and for that run the first method's lowest-concurrency run."""
    first: dict[str, Run] = {}
    for run in runs:
        first.setdefault(run.method, run)
    reference_method = runs[0].method if runs else None
    for run in runs:
        ref = first[run.method] if run is not first[run.method] else first[reference_method]
        if ref is run:
            continue
        texts = {c.prompt: c.text for c in ref.calls if c.ok}
        run.mismatches = sum(1 for c in run.calls if c.ok and c.prompt in texts and c.text != texts[c.prompt])


@contextmanager
def spawned_server(methods: str, target: str | None, draft: str | None, log_path: Path):
    """`draftverify serve` on a free loopback port for the duration of the block; yields its base URL."""
    args = [
        sys.executable,
        "-m",
        "draftverify.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--methods",
        methods,
        "--log-level",
        "warning",
        "--max-queue",
        "64",
    ]
    if target:
        args += ["--target", target]
    if draft:
        args += ["--draft", draft]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # unbuffered bytes: what select() reports ready is all there is, nothing hides in a reader's buffer
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=log, bufsize=0, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        try:
            base, until = None, time.monotonic() + SPAWN_WAIT_S
            while base is None:
                ready, _, _ = select.select(
                    [proc.stdout], [], [], max(0.0, until - time.monotonic())
                )  # never block past the bound
                require(ready, f"the spawned server did not listen within {SPAWN_WAIT_S:.0f} s: see {log_path}")
                line = proc.stdout.readline()
                require(
                    line or proc.poll() is None,
                    f"the spawned server exited (code {proc.poll()}) before listening: see {log_path}",
                )
                found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line.decode(errors="replace"))
                base = found.group(1) if found else None
            yield base
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def served_model(base: str) -> str:
    import httpx

    models = httpx.get(f"{base}/models", timeout=30).json()["data"]
    require(models, f"{base}/models lists no model")
    return models[0]["id"]


async def warm_up(base: str, model: str, methods: list[str], prompt: str, ask: Ask) -> None:
    """One short untimed request per method before any run: what a server does once (a grammar's view of the
    vocabulary, a method's first-request set-up) is charged to no method's run."""
    import httpx

    short = replace(ask, max_tokens=min(ask.max_tokens, 8))
    async with httpx.AsyncClient() as client:
        for method in methods:
            await one_call(client, base, model, method, 0, prompt, short)


def load(
    base: str,
    methods: list[str],
    concurrency: list[int],
    prompts: list[str],
    requests: int,
    ask: Ask,
    time_limit_s: float,
    server: str,
    command: str,
    prompt_source: str,
    format_file: str | None = None,
    log=print,
) -> dict:
    """Every (method, concurrency) run, in order; returns the results object (see the module docstring).
    `format_file` names where `ask.response_format` was read from, for the record."""
    model = served_model(base)
    runs = []
    deadline = time.monotonic() + time_limit_s
    asyncio.run(warm_up(base, model, methods, prompts[0], ask))
    for method in methods:
        for c in concurrency:
            run = asyncio.run(run_load(base, model, method, prompts, c, requests, ask, deadline))
            runs.append(run)
            invalid = "" if run.invalid is None else f", {run.invalid} invalid"
            log(
                f"{method} x{c}: {run.requests} requests, {run.errors} errors{invalid}, "
                f"{run.tokens_per_s:.1f} tokens/s, latency p50 {run.latency_p50_s or 0:.2f} s"
            )
    count_mismatches(runs)
    return {
        "command": command,
        "server": server,
        "model": model,
        "settings": {
            "requests": requests,
            "max_tokens": ask.max_tokens,
            "concurrency": concurrency,
            "methods": methods,
            "prompts": prompt_source,
            "system": ask.system,
            "response_format_file": format_file,
            "response_format": ask.response_format,
        },
        "runs": [without_gaps(asdict(r)) for r in runs],
    }
