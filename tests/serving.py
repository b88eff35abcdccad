"""The live server the serve tests share: `serving` (uvicorn in a thread on 127.0.0.1, tiny models), an engine
they can hold (`GatedEngine`), the offline outputs to compare with (`expect`), and readers of streams and
metrics. The `models` (target, draft) and `offline` fixtures they use are in conftest.py."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx

from draftverify import Engine
from draftverify.serve import ServeConfig, Server, create_app, parse_methods

METHODS = "speculative:k4,autoregressive"
# k4: a constant draft length (a seeded sampled request equals the offline one at the same draft lengths: docs/serve.md)
OPTIONS = {
    "speculative:k4": ("speculative", {"k": 4, "policy": "constant"}),
    "autoregressive": ("autoregressive", {}),
}
WAIT_S = 60  # the longest any single wait in these tests may take


class GatedEngine(Engine):
    """An engine the tests can hold: each generation waits for `gate`, sleeps `delay` s per chunk,
    raises `fail` (once) at its first chunk, and waits for `flowing` after each chunk it hands on."""

    def __init__(self, target, draft):
        super().__init__(target, draft)
        self.gate = threading.Event()
        self.gate.set()
        self.flowing = threading.Event()
        self.flowing.set()
        self.delay = 0.0
        self.fail: Exception | None = None

    def request(self, prompt, method="auto", on_tokens=None, **kwargs):  # the server starts every request here
        assert self.gate.wait(WAIT_S)

        def slowly(tokens):
            time.sleep(self.delay)
            if self.fail is not None:
                fail, self.fail = self.fail, None
                raise fail
            handed = on_tokens(tokens)
            assert self.flowing.wait(WAIT_S)
            return handed

        return super().request(prompt, method, on_tokens=slowly if on_tokens is not None else None, **kwargs)


@contextmanager
def serving(engine: Engine, methods: str = METHODS, **config):
    """A live server for `engine` on a free 127.0.0.1 port: yields (httpx client, Server)."""
    app = create_app(engine, ServeConfig(methods=parse_methods(methods), **config))
    server = Server(app, port=0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    client = httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S)
    try:
        yield client, server
    finally:
        client.close()
        server.should_exit = True
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the server did not stop"


def url_of(client: httpx.Client) -> str:
    return str(client.base_url).rstrip("/")


def sse_events(source) -> list:
    """The `data:` payloads of a server-sent event stream ([DONE] kept as the string), from a
    response or from the rest of its lines."""
    events = []
    for line in source.iter_lines() if hasattr(source, "iter_lines") else source:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", line
    return events


def streamed_text(events: list) -> str:
    """The text of a stream's chunks (chat deltas or completion texts)."""
    choices = [c for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    return "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices)


def finish_of(events: list) -> str:
    return next(
        c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", []) if c["finish_reason"]
    )


def first_text(lines) -> dict:
    """Read a stream up to its first chunk with text."""
    for line in lines:
        if line.startswith("data: ") and streamed_text([json.loads(line[6:])]):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without text")


def expect(offline: Engine, prompt, method: str = "speculative:k4", chat: bool = False, **kwargs):
    name, options = OPTIONS[method]
    return offline.generate(prompt, method=name, chat=chat, **options, **kwargs)


C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]


def wait_for(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text, read by prometheus_client's own parser -> {sample name with labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation and family.type in ("counter", "gauge"), family
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))  # keys name labels in sorted order
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
