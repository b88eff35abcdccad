"""`draftverify serve` under load (a full queue answers 429; 50 requests from 8 clients, some hanging up), a failing
generation, timeouts, disconnects and shutdown, the Ouroboros pool shared across requests, and the real model
streamed: each over real HTTP on 127.0.0.1 (serving.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import (
    CHAT,
    GOOD,
    MSG,
    OPTIONS,
    WAIT_S,
    C,
    GatedEngine,
    expect,
    finish_of,
    first_text,
    parse_metrics,
    serving,
    sse_events,
    streamed_text,
    url_of,
    wait_for,
)

from draftverify import DraftVerifyError, Engine
from draftverify.serve import ServeConfig, create_app, parse_methods

# -- under load --------------------------------------------------------------------------------


def test_full_queue_answers_429_and_the_rest_complete(models, offline):
    engine = GatedEngine(*models)
    want = expect(offline, "Hello", max_new_tokens=4, temperature=0.0).text
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with serving(engine, max_queue=2, max_batch=1) as (client, server), ThreadPoolExecutor(3) as pool:
        engine.gate.clear()
        url = url_of(client)
        held = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=WAIT_S)]
        wait_for(lambda: client.get("/health").json()["busy"])
        held += [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=WAIT_S) for _ in range(2)]
        wait_for(lambda: client.get("/health").json()["queue_depth"] == 2)
        for _ in range(3):
            r = client.post(C, json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1
        engine.gate.set()
        assert [f.result().json()["choices"][0]["text"] for f in held] == [want] * 3
        assert (
            parse_metrics(client.get("/metrics").text)[
                'draftverify_requests_total{route="/v1/completions",status="429"}'
            ]
            == 3
        )


def load_kinds() -> list[dict]:
    """The 50 requests: both routes and methods, greedy and seeded sampling, streamed or not; every fifth hangs up
    after its first streamed text."""
    kinds = []
    for i in range(50):
        hangup = i % 5 == 4  # greedy from "Hello": no EOS for a long while (checked below), so the cancel must cut it
        sampling = {"temperature": 0.0} if (i // 2) % 2 or hangup else {"temperature": 0.8, "seed": 5}
        prompt = "Hello" if hangup or i % 3 else "The cat"
        kinds.append(
            {
                "i": i,
                "chat": not hangup and (i // 4) % 2 == 1,
                "stream": i % 3 == 0,
                "method": list(OPTIONS)[i % 2],
                "prompt": prompt,
                "sampling": sampling,
                "hangup": hangup,
            }
        )
    return kinds


def offline_texts(offline, kinds: list[dict]) -> dict[int, str]:
    """Each request's (but the hang-ups') text as offline generation gives it, by its index."""
    wants, cases = {}, {}
    for k in kinds:
        if not k["hangup"]:
            case = (k["prompt"], k["chat"], k["method"], tuple(k["sampling"].items()))
            if case not in cases:
                prompt = [{"role": "user", "content": k["prompt"]}] if k["chat"] else k["prompt"]
                cases[case] = expect(
                    offline, prompt, k["method"], chat=k["chat"], max_new_tokens=4, **k["sampling"]
                ).text
            wants[k["i"]] = cases[case]
    return wants


def send(client: httpx.Client, k: dict) -> tuple[int, str]:
    """Send request `k`: its status and text ("hung up" for a hang-up, which leaves after its first text)."""
    route = CHAT if k["chat"] else C
    body = {
        "max_tokens": 300 if k["hangup"] else 4,
        "method": k["method"],
        **k["sampling"],
        "stream": k["stream"] or k["hangup"],
    }
    body.update({"messages": [{"role": "user", "content": k["prompt"]}]} if k["chat"] else {"prompt": k["prompt"]})
    if not body["stream"]:
        r = client.post(route, json=body)
        return r.status_code, r.json()["choices"][0]["message"]["content"] if k["chat"] else r.json()["choices"][0][
            "text"
        ]
    with client.stream("POST", route, json=body) as r:
        if k["hangup"]:
            first_text(r.iter_lines())
            return r.status_code, "hung up"
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return r.status_code, streamed_text(events)


def test_load_50_requests_8_clients_some_disconnecting(models, offline):
    """8 clients send 50 requests (`load_kinds`); every fifth request hangs up after its first streamed text. With
    room for 8 waiting requests nobody is refused; nothing fails; every answer equals offline generation; every
    hang-up cancels its (long) generation."""
    kinds = load_kinds()
    assert 0 not in expect(offline, "Hello", max_new_tokens=30, temperature=0.0, eos_token_id=[]).tokens
    wants = offline_texts(offline, kinds)

    def client_loop(mine: list[dict]) -> list[tuple[int, str]]:
        with httpx.Client(base_url=url, timeout=WAIT_S) as client:
            return [send(client, k) for k in mine]

    with serving(Engine(*models), max_queue=8) as (client, server), ThreadPoolExecutor(8) as pool:
        url = url_of(client)
        futures = [pool.submit(client_loop, kinds[c::8]) for c in range(8)]
        results = {}
        for c, f in enumerate(futures):
            for k, (status, text) in zip(kinds[c::8], f.result(timeout=600)):
                results[k["i"]] = (status, text)
        assert all(status == 200 for status, _ in results.values()), results
        assert {i: text for i, (_, text) in results.items() if i in wants} == wants
        wait_for(lambda: not client.get("/health").json()["busy"])
        samples = parse_metrics(client.get("/metrics").text)
        hangups = sum(k["hangup"] for k in kinds)
        cancelled = sum(
            v
            for name, v in samples.items()
            if name.startswith("draftverify_generations_total") and 'finish_reason="cancelled"' in name
        )
        assert cancelled == hangups
        assert not any(name.startswith("draftverify_requests_total") and 'status="5' in name for name in samples)
        r = client.post(C, json=GOOD)
        assert (
            r.status_code == 200
            and r.json()["choices"][0]["text"] == expect(offline, "Hello", max_new_tokens=2, temperature=0.0).text
        )


def test_a_failing_generation_is_its_own_500_and_the_server_goes_on(models, offline):
    engine = GatedEngine(*models)
    want = expect(offline, "Hello", max_new_tokens=2, temperature=0.0).text
    with serving(engine) as (client, server):
        engine.fail = RuntimeError("CUDA out of memory (pretend)\nsecond line")
        r = client.post(C, json={**GOOD, "max_tokens": 20})
        assert (
            r.status_code == 500
            and r.json()["error"]["message"] == "generation failed: RuntimeError: CUDA out of memory (pretend)"
        )
        engine.fail = RuntimeError("again")
        with client.stream("POST", C, json={**GOOD, "max_tokens": 20, "stream": True}) as r:
            events = sse_events(r)
        assert r.status_code == 200 and events[-2]["error"]["code"] == "generation_failed" and events[-1] == "[DONE]"
        r = client.post(C, json=GOOD)  # the caches left mid-generation do not leak into the next request
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        samples = parse_metrics(client.get("/metrics").text)
        assert samples['draftverify_generations_total{finish_reason="error",method="speculative:k4"}'] == 2


# -- timeouts and shutdown ---------------------------------------------------------------------


def test_timeout_cuts_running_and_waiting_requests(models, offline):
    engine = GatedEngine(*models)
    engine.delay = 0.05
    long = {"prompt": "Hello", "max_tokens": 400, "temperature": 0}
    with serving(engine, timeout_s=1.5) as (client, server):
        t = time.monotonic()
        r = client.post(C, json=long)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout" and time.monotonic() - t < 1.5 + 5
        with client.stream("POST", C, json={**long, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout" and streamed_text(events[:-1])
        # a request that times out while waiting in line
        engine.gate.clear()
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, C, json=GOOD)
            wait_for(lambda: client.get("/health").json()["busy"])
            r = client.post(C, json=GOOD)
            assert r.status_code == 504 and client.get("/health").json()["queue_depth"] == 0
            engine.gate.set()
            assert first.result().status_code == 504  # it waited at the gate past its deadline
        r = client.post(C, json=GOOD)
        assert (
            r.status_code == 200
            and r.json()["choices"][0]["text"] == expect(offline, "Hello", max_new_tokens=2, temperature=0.0).text
        )


def test_disconnect_frees_the_model(models):
    engine = GatedEngine(*models)
    engine.delay = 0.05
    with serving(engine) as (client, server):
        for route, body in ((C, {"prompt": "Hello"}), (CHAT, {"messages": MSG})):
            with client.stream("POST", route, json={**body, "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                first_text(r.iter_lines())
        wait_for(lambda: not client.get("/health").json()["busy"], timeout_s=10)
        with ThreadPoolExecutor(1) as pool:  # a non-streamed request whose client gives up
            engine.gate.clear()
            gone = pool.submit(
                httpx.post,
                f"{url_of(client)}/v1/completions",
                json={"prompt": "Hello", "max_tokens": 400, "temperature": 0},
                timeout=1.0,
            )
            wait_for(lambda: client.get("/health").json()["busy"])
            engine.gate.set()
            with pytest.raises(httpx.ReadTimeout):
                gone.result()
        wait_for(lambda: not client.get("/health").json()["busy"], timeout_s=10)
        samples = parse_metrics(client.get("/metrics").text)
        assert samples['draftverify_generations_total{finish_reason="cancelled",method="speculative:k4"}'] == 3
        assert samples['draftverify_generated_tokens_total{method="speculative:k4"}'] < 3 * 100


@pytest.mark.parametrize("grace_s", [0.0, 30.0])
def test_shutdown_during_a_stream(models, offline, grace_s):
    """Shutdown refuses waiting requests at once (503); the running stream finishes within the
    grace period, or ends with an error event; either way it ends with [DONE] and the server stops."""
    engine = GatedEngine(*models)
    engine.delay = 0.02
    engine.flowing.clear()  # the stream stops after its first chunk until the shutdown has begun
    n = 300 if grace_s == 0 else 10
    want = expect(offline, "Hello", max_new_tokens=10, temperature=0.0).text
    with serving(engine, shutdown_grace_s=grace_s, max_batch=1) as (client, server), ThreadPoolExecutor(1) as pool:
        with client.stream("POST", C, json={"prompt": "Hello", "max_tokens": n, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            events = [first_text(lines)]
            waiting = pool.submit(httpx.post, f"{url_of(client)}/v1/completions", json=GOOD, timeout=WAIT_S)
            wait_for(lambda: client.get("/health").json()["queue_depth"] == 1)
            server.should_exit = True
            assert waiting.result().status_code == 503
            engine.flowing.set()
            events += sse_events(lines)
        assert events[-1] == "[DONE]"
        if grace_s:
            assert finish_of(events) == "length" and streamed_text(events) == want
        else:
            got = streamed_text(events)
            assert events[-2]["error"]["code"] == "shutting_down" and got[: len(want)] == want[: len(got)]


# -- the Ouroboros pool --------------------------------------------------------------------------


def test_pool_is_shared_across_requests_saved_and_loaded(models, offline, tmp_path):
    from draftverify.drafters.pool import PhrasePool
    from draftverify.loading import tokenizer_fingerprint

    target = models[0]
    path = tmp_path / "pool.json"
    prompts = ["Hello", "The cat"]
    wants = [expect(offline, p, "autoregressive", max_new_tokens=12, temperature=0.0).text for p in prompts]
    counts = []
    with serving(Engine(*models), methods="ouroboros,autoregressive", pool_file=path) as (client, server):
        method = server.service.pooled[0]
        assert method.config.pool_file == str(path) and method.config.reuse
        for prompt, want in zip(prompts, wants):
            out = client.post(C, json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
            assert out["choices"][0]["text"] == want  # lossless whatever the pool holds
            counts.append(out["draftverify"]["extra"]["pool_phrases"])
        assert counts[0] > 0 and len(method.pool) == counts[-1]  # the requests ran on the one pooled instance
    saved = PhrasePool.load(path, tokenizer_fingerprint(target.tokenizer), method.config.N, method.config.G)
    assert len(saved) == counts[-1]
    # a restart (fresh method instances) starts from the saved pool
    with serving(Engine(*models), methods="ouroboros", pool_file=path) as (client, server):
        assert len(server.service.pooled[0].pool) == len(saved)
        out = client.post(C, json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0}).json()
        assert out["choices"][0]["text"] == wants[0]
    path.write_text('{"format": "something else"}')
    with pytest.raises(DraftVerifyError, match="not a draftverify phrase pool"):
        create_app(Engine(*models), ServeConfig(methods=parse_methods("ouroboros"), pool_file=path))
    with pytest.raises(DraftVerifyError, match="exactly one loaded method with a pool"):
        create_app(Engine(*models), ServeConfig(methods=parse_methods("ouroboros,lookahead"), pool_file=path))


@pytest.mark.slow
def test_real_model_chat_streamed_equals_offline(smollm):
    """SmolLM2's own chat template and byte-level tokenizer, streamed through the server."""
    messages = [{"role": "user", "content": "Name three colours, in French."}]
    want = Engine(smollm).generate(messages, method="autoregressive", chat=True, max_new_tokens=10, temperature=0.0)
    with serving(Engine(smollm), methods="autoregressive") as (client, server):
        with client.stream(
            "POST", CHAT, json={"messages": messages, "max_tokens": 10, "temperature": 0, "stream": True}
        ) as r:
            events = sse_events(r)
    assert streamed_text(events) == want.text and events[-1] == "[DONE]"
    assert events[-2]["draftverify"]["new_tokens"] == len(want.tokens)
