"""`draftverify serve` as real processes: two replicas of a saved tiny model on 127.0.0.1 behind a
round-robin client (one of them placed with `--device-map auto`), a SIGTERM during a stream, a
SIGINT, and the CLI's one-line errors."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from serving import first_text, sse_events, streamed_text

from draftverify import DraftVerifyError, Engine
from draftverify.loading import load_draft, load_model
from draftverify.methods.spec import parse_spec

START_S = 180  # a replica imports torch, transformers and FastAPI, then loads the model
WAIT_S = 60


class Replica:
    """`draftverify serve ... --port 0` in a subprocess; `url` once `ready()` read where it listens."""

    def __init__(self, args: list[str], log_path):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "draftverify.cli", "serve", *args, "--port", "0", "--log-level", "warning"],
            stdout=subprocess.PIPE,
            stderr=open(log_path, "w"),
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def ready(self) -> "Replica":
        try:
            line = self.lines.get(timeout=START_S)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"the replica did not start: {self.log()}")
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line + self.log()
        self.url = match[1]
        return self

    def log(self) -> str:
        return open(self.log_path).read()

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(WAIT_S)


class RoundRobin:
    """The load balancer of these tests: each request goes to the next replica; one that refuses
    the connection is skipped (as nginx does with `proxy_next_upstream error`)."""

    def __init__(self, urls: list[str]):
        self.urls, self.turn = urls, 0

    def post(self, path: str, body: dict) -> tuple[str, httpx.Response]:
        for _ in self.urls:
            url = self.urls[self.turn % len(self.urls)]
            self.turn += 1
            try:
                return url, httpx.post(url + path, json=body, timeout=WAIT_S)
            except httpx.ConnectError:
                continue
        raise AssertionError("no replica answered")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    folder = tmp_path_factory.mktemp("served") / "tiny-llama"
    target = tiny("llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def assert_every_case_equals_offline_on_both(lb: RoundRobin, offline: Engine, spec: str) -> None:
    """Greedy and seeded sampling, `spec` and autoregressive, each case twice: round robin serves it on both
    replicas, each answer equal to offline generation."""
    cases = [
        (spec, {"temperature": 0.0}),
        ("autoregressive", {"temperature": 0.0}),
        (spec, {"temperature": 0.7, "seed": 3}),
        ("autoregressive", {"temperature": 0.7, "seed": 3}),
    ]
    served = set()
    for method, sampling in cases * 2:  # every case on both replicas
        parsed = parse_spec(method)
        want = offline.generate("Hello", method=parsed.name, max_new_tokens=6, **sampling, **dict(parsed.options)).text
        url, r = lb.post("/v1/completions", {"prompt": "Hello", "max_tokens": 6, "method": method, **sampling})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (url, method, sampling)
        served.add(url)
    assert served == set(lb.urls)


def assert_sigterm_ends_the_stream_cleanly(replica: Replica, offline: Engine) -> None:
    """SIGTERM to `replica` during a stream: the stream ends with its error event and [DONE], the replica exits."""
    greedy = offline.generate("Hello", method="autoregressive", max_new_tokens=20, temperature=0.0).text
    with httpx.stream(
        "POST",
        replica.url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True},
        timeout=WAIT_S,
    ) as r:
        lines = r.iter_lines()
        events = [first_text(lines)]
        replica.proc.send_signal(signal.SIGTERM)
        events += sse_events(lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
    got = streamed_text(events)
    assert got[: len(greedy)] == greedy[: len(got)]
    assert replica.proc.wait(WAIT_S) == -signal.SIGTERM  # uvicorn re-raises the signal after a clean shutdown
    assert "Traceback" not in replica.log()


def test_two_replicas_behind_round_robin(model_dir, tmp_path):
    # a constant draft length: the default `cost` policy picks lengths from forward times each
    # process measures for itself, so a seeded sample is reproducible across processes only with fixed lengths
    spec = "speculative[k=3,policy=constant]"
    args = ["--target", str(model_dir), "--draft", "self:layers=2", "--methods", f"{spec},autoregressive"]
    args += ["--device", "cpu"]
    a = Replica([*args, "--shutdown-grace", "0"], tmp_path / "a.log")
    b = Replica([*args, "--device-map", "auto"], tmp_path / "b.log")
    try:
        a.ready(), b.ready()
        target = load_model(model_dir, device="cpu")
        offline = Engine(target, load_draft("self:layers=2", target))
        lb = RoundRobin([a.url, b.url])
        assert_every_case_equals_offline_on_both(lb, offline, spec)
        assert_sigterm_ends_the_stream_cleanly(a, offline)
        for _ in range(2):  # b takes over
            url, r = lb.post(
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
            )
            assert url == b.url and r.status_code == 200
        assert b.stop(signal.SIGINT) == 0 and "Traceback" not in b.log()
    finally:
        for replica in (a, b):
            if replica.proc.poll() is None:
                replica.proc.kill()


def test_cli_errors_are_one_line(model_dir, tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app

    runner = CliRunner()
    corrupt = tmp_path / "pool.json"
    corrupt.write_text("{not json")
    for args, message in (
        (["--methods", "nope"], "unknown method 'nope'"),
        (["--methods", "speculative[k=4"], "unclosed"),
        (["--timeout", "0"], "timeout=0.0 must be positive"),
        (["--pool-file", str(corrupt)], "exactly one loaded method with a pool"),
        (["--methods", "ouroboros", "--pool-file", str(corrupt)], "corrupt"),
    ):
        res = runner.invoke(
            app, ["serve", "--target", str(model_dir), "--draft", "self:layers=2", "--device", "cpu", *args]
        )
        assert isinstance(res.exception, DraftVerifyError), (args, res.output)
        assert message in str(res.exception) and "\n" not in str(res.exception)
    res = runner.invoke(app, ["serve", "--help"])
    assert (
        res.exit_code == 0
        and "--max-queue" in res.stdout
        and "--pool-file" in res.stdout
        and "--device-map" in res.stdout
    )
