"""draftverify on Ray Serve (draftverify.serve.ray_deploy): a local Ray cluster on this machine, two
replicas of a saved tiny model behind the gateway. Requests spread over both replicas and answer what
offline generation answers; one replica is killed (SIGKILL) while streams and plain requests run on
both, and only its in-flight requests fail, each with a clean JSON error (503, or an error event that
ends the stream); later requests all succeed. Skipped, with the reason, without the `ray` extra."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install 'draftverify[ray]'")

from draftverify import Engine  # noqa: E402
from draftverify.loading import load_draft, load_model  # noqa: E402
from draftverify.methods.spec import parse_spec  # noqa: E402
from draftverify.serve import ray_deploy  # noqa: E402
from draftverify.serve.app import ServeConfig, parse_methods  # noqa: E402

SPEC = "speculative[k=3,policy=constant]"  # fixed draft lengths: seeded samples agree across processes
CASES = [
    (SPEC, {"temperature": 0.0}),
    ("autoregressive", {"temperature": 0.0}),
    (SPEC, {"temperature": 0.7, "seed": 3}),
    ("autoregressive", {"temperature": 0.7, "seed": 5}),
]
WAIT_S = 60
LONG = 400  # new tokens of the requests running when the replica dies (greedy "Hello" stops earlier, at EOS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    folder = tmp_path_factory.mktemp("ray") / "tiny-llama"
    target = tiny("llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def offline(model_dir):
    target = load_model(model_dir, device="cpu")
    engine = Engine(target, load_draft("self:layers=2", target))

    def generate(method: str, max_tokens: int, **sampling) -> str:
        spec = parse_spec(method)
        return engine.generate(
            "Hello", method=spec.name, max_new_tokens=max_tokens, **sampling, **dict(spec.options)
        ).text

    return generate


@pytest.fixture(scope="module")
def url(model_dir):
    """Two replicas of one CPU each on a local two-CPU Ray cluster; taken down even if a test fails."""
    settings = ray_deploy.RaySettings(replicas=2, num_cpus=1, port=free_port())
    load = ray_deploy.EngineArgs(str(model_dir), "self:layers=2", device="cpu")
    config = ServeConfig(methods=parse_methods(f"{SPEC},autoregressive"), max_batch=4, shutdown_grace_s=1)
    try:
        ray_deploy.connect(None, num_cpus=2)
        yield ray_deploy.start(settings, load, config)
    finally:
        # undrained: a graceful stop would wait for the replica Ray restarts after the kill to finish loading
        ray_deploy.stop(graceful=False)


def complete(url: str, method: str, max_tokens: int, **sampling) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": max_tokens, "method": method, **sampling}
    return httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)


def test_requests_spread_over_both_replicas_and_equal_offline(url, offline):
    seen = set()
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):  # Ray picks the less loaded of two replicas: concurrent requests reach both
            futures = {pool.submit(complete, url, m, 8, **s): (m, s) for m, s in CASES * 2}
            for future, (method, sampling) in futures.items():
                r = future.result()
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == offline(method, 8, **sampling), (method, sampling)
                seen.add((r.headers[ray_deploy.REPLICA_HEADER], int(r.headers[ray_deploy.PID_HEADER])))
            if len(seen) == 2:
                break
    assert len(seen) == 2, seen
    r = httpx.get(url + "/v1/models", timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["data"][0]["methods"] == [SPEC, "autoregressive"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 0}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # the app's own errors pass through


class Stream(threading.Thread):
    """A long greedy stream; `replica` (pid) once its headers came, then every `data:` payload."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.pid, self.events, self.started = url, None, [], threading.Event()
        self.status = self.error = None

    def run(self):
        body = {"prompt": "Hello", "max_tokens": LONG, "temperature": 0, "stream": True, "method": "autoregressive"}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
            self.status = r.status_code
            if r.status_code != 200:  # its replica went before the stream began: an error response, no stream
                self.error = json.loads(r.read())["error"]
                return
            self.pid = int(r.headers[ray_deploy.PID_HEADER])
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    self.started.set()

    def text(self) -> str:
        return "".join(c["text"] for e in self.events if isinstance(e, dict) for c in e.get("choices", []))


def test_a_replica_killed_mid_load_fails_only_its_in_flight_requests(url, offline):
    greedy = offline("autoregressive", LONG, temperature=0.0)
    streams = [Stream(url) for _ in range(4)]
    for s in streams:
        s.start()
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(complete, url, "autoregressive", LONG, temperature=0) for _ in range(4)]
        deadline = time.monotonic() + WAIT_S
        while len({s.pid for s in streams if s.started.is_set()}) < 2:  # both replicas are streaming
            assert time.monotonic() < deadline, "the streams did not reach both replicas"
            time.sleep(0.005)
        victim = next(s.pid for s in streams if s.started.is_set())
        os.kill(victim, signal.SIGKILL)
        answers = [f.result() for f in plain]
    for s in streams:
        s.join(WAIT_S)
        assert not s.is_alive()
        if s.status == 503:  # queued on the victim, not yet begun: the plain requests' error
            assert s.error["code"] == "replica_unavailable"
            continue
        assert s.status == 200 and s.events[-1] == "[DONE]"
        if s.pid == victim and "error" in s.events[-2]:  # cut: an error event, the text so far a prefix
            assert s.events[-2]["error"]["code"] == "replica_unavailable"
            assert greedy.startswith(s.text())
        else:  # the survivor's streams (and any of the victim's that ended before the kill) are whole
            assert s.text() == greedy
    cut = [s for s in streams if s.status == 200 and "error" in s.events[-2]]
    assert cut and all(s.pid == victim for s in cut)  # the killed replica had a stream in flight
    for r in answers:
        if r.status_code == 503:  # in flight on the victim: the server's error format, no hang
            assert r.json()["error"]["code"] == "replica_unavailable"
        else:
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, r.text
    for method, sampling in CASES:  # after the kill: nothing lost
        r = complete(url, method, 8, **sampling)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(method, 8, **sampling)
        assert int(r.headers[ray_deploy.PID_HEADER]) != victim


def test_settings_refuse_bad_values_in_one_line():
    from draftverify import DraftVerifyError

    for kwargs, message in (
        ({"replicas": 0}, "replicas=0 must be at least 1"),
        ({"num_cpus": 0}, "num_cpus=0 must be positive"),
        ({"port": 0}, "port=0 must be a TCP port"),
    ):
        with pytest.raises(DraftVerifyError, match=message) as info:
            ray_deploy.RaySettings(**kwargs)
        assert "\n" not in str(info.value)
    assert ray_deploy.RaySettings(num_cpus=0.5).threads == 1
