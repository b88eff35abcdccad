"""`draftverify serve` over real HTTP on 127.0.0.1 (uvicorn in a thread, tiny models): outputs equal
offline `Engine.generate`, streamed or not; bad input gets its OpenAI-format 4xx and harms nothing;
the queue answers 429 when full; disconnects, timeouts and shutdown cancel cleanly."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from draftverify import DraftVerifyError, Engine
from draftverify.serve import ServeConfig, Server, create_app, parse_methods
from draftverify.serve.protocol import TextStream

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


@pytest.fixture(scope="module")
def models(tiny):
    return tiny("llama"), tiny("llama", seed=1, layers=2)


@pytest.fixture(scope="module")
def offline(models):
    """An engine of its own (own caches) for the expected outputs."""
    return Engine(*models)


def expect(offline: Engine, prompt, method: str = "speculative:k4", chat: bool = False, **kwargs):
    name, options = OPTIONS[method]
    return offline.generate(prompt, method=name, chat=chat, **options, **kwargs)


@pytest.fixture(scope="module")
def live(models):
    with serving(Engine(*models), max_body_bytes=64 << 10) as (client, server):
        yield client, server


# -- outputs equal offline generation ---------------------------------------------------------


@pytest.mark.parametrize("method", list(OPTIONS))
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "top_k": 30, "seed": 11}]
)
def test_completion_equals_offline(live, offline, method, sampling):
    client, _ = live
    want = expect(offline, "Hello there", method, max_new_tokens=12, **sampling)
    body = {"prompt": "Hello there", "max_tokens": 12, "method": method, **sampling}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == want.text
    assert out["usage"] == {
        "prompt_tokens": len(want.prompt_tokens),
        "completion_tokens": len(want.tokens),
        "total_tokens": len(want.prompt_tokens) + len(want.tokens),
    }
    assert out["choices"][0]["finish_reason"] == {"eos": "stop", "length": "length"}[want.stats.finish_reason]
    stats = out["draftverify"]
    assert stats["method"] == method and stats["target_forwards"] == want.stats.target_forwards
    assert stats["accepted_per_forward"] == pytest.approx(want.stats.accepted_per_forward)
    assert stats["acceptance_rate"] == want.stats.acceptance_rate  # None for autoregressive: unknown, not 0
    assert stats["tokens_per_s"] > 0
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and streamed_text(events) == want.text
    assert finish_of(events) == out["choices"][0]["finish_reason"]
    assert events[-2]["draftverify"]["target_forwards"] == want.stats.target_forwards


def test_stop_string_cut_streamed_and_not(live, offline):
    client, _ = live
    full = expect(offline, "Hello there", max_new_tokens=20, temperature=0.0, eos_token_id=[])
    stop = full.text[8:10]
    want = expect(offline, "Hello there", max_new_tokens=20, temperature=0.0, stop=stop)
    assert stop not in want.text and want.text == full.text[: full.text.find(stop)]
    body = {"prompt": "Hello there", "max_tokens": 20, "temperature": 0, "stop": [stop, "@@never@@"]}
    r = client.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == want.text and r.json()["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert streamed_text(events) == want.text and finish_of(events) == "stop"


def test_chat_template_applied(live, offline, tokenizer):
    client, _ = live
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = expect(offline, messages, chat=True, max_new_tokens=10, temperature=0.0)
    assert tokenizer.decode(want.prompt_tokens) == "<system>Be brief.\n<user>hi\n<assistant>"
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    for sent in (messages, parts):
        r = client.post("/v1/chat/completions", json={"messages": sent, "max_tokens": 10, "temperature": 0})
        out = r.json()
        assert out["object"] == "chat.completion" and out["choices"][0]["message"] == {
            "role": "assistant",
            "content": want.text,
        }
        assert out["usage"]["prompt_tokens"] == len(want.prompt_tokens)
    body = {
        "messages": messages,
        "max_completion_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    assert streamed_text(events) == want.text
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == len(want.tokens)


def test_openai_client(live, offline):
    import openai

    client, server = live
    api = openai.OpenAI(base_url=f"{url_of(client)}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    model = api.models.list().data[0].id
    want = expect(offline, "Hello", "autoregressive", max_new_tokens=8, temperature=0.0)
    out = api.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0, extra_body={"method": "autoregressive"}
    )
    assert out.choices[0].text == want.text and out.model_extra["draftverify"]["method"] == "autoregressive"
    want = expect(offline, [{"role": "user", "content": "hi"}], chat=True, max_new_tokens=8, temperature=0.0)
    chunks = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt="Hello", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="Hello")


def test_models_health_metrics(live):
    client, _ = live
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["methods"] == ["speculative:k4", "autoregressive"]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["queue_capacity"] == 16 and health["busy"] is False
    # long enough to draft (a reply that ends at its first token drafts nothing), whatever ran before on this server
    r = client.post(
        "/v1/completions", json={"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "method": "speculative"}
    )
    assert r.json()["draftverify"]["method"] == "speculative:k4"  # a bare name picks the one loaded spec of that method
    text = client.get("/metrics").text
    samples = parse_metrics(text)
    assert samples['draftverify_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert samples["draftverify_queue_depth"] == 0 and samples["draftverify_queue_capacity"] == 16
    assert samples['draftverify_generated_tokens_total{method="speculative:k4"}'] >= 3
    drafted = samples['draftverify_drafted_tokens_total{method="speculative:k4"}']
    assert drafted > 0
    assert samples['draftverify_acceptance_rate{method="speculative:k4"}'] == pytest.approx(
        samples['draftverify_accepted_tokens_total{method="speculative:k4"}'] / drafted, abs=1e-5
    )
    at = {  # position -> verifications that accepted the drafted token there
        int(name.split('position="')[1].split('"')[0]): v
        for name, v in samples.items()
        if name.startswith("draftverify_accepted_at_position_total{")
    }
    assert sum(at.values()) <= samples['draftverify_accepted_tokens_total{method="speculative:k4"}']
    assert all(at[p] >= at.get(p + 1, 0) for p in at)  # a token is accepted only after the one before it
    assert at.get(1, 0) <= samples['draftverify_verifications_total{method="speculative:k4"}']


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


# -- bad input ----------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (route, body: dict merged into a good one, or raw bytes), status, param
    (C, b"{", 400, None),
    (C, b'{"prompt": "Hello", "max_tokens": 2,}', 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"\xff\xfe", 400, None),
    (C, b'{"prompt": "Hello", "temperature": NaN}', 400, "temperature"),
    (C, b'{"prompt": "Hello", "temperature": Infinity}', 400, "temperature"),
    (C, {"temprature": 0.5}, 400, "temprature"),
    (C, {"stream_options": {"include_usage": True, "extra": 1}}, 400, "stream_options.extra"),
    (C, {"max_tokens": 0}, 400, "max_tokens"),
    (C, {"max_tokens": -5}, 400, "max_tokens"),
    (C, {"max_tokens": 10**12}, 400, "max_tokens"),
    (C, {"max_tokens": "8"}, 400, "max_tokens"),
    (C, {"max_tokens": 2.5}, 400, "max_tokens"),
    (C, {"temperature": -0.1}, 400, "temperature"),
    (C, {"temperature": 1e-40}, 400, "temperature"),
    (C, {"temperature": "hot"}, 400, "temperature"),
    (C, {"top_p": 0}, 400, "top_p"),
    (C, {"top_p": 1.5}, 400, "top_p"),
    (C, {"top_k": -1}, 400, "top_k"),
    (C, {"seed": -1}, 400, "seed"),
    (C, {"seed": 2**70}, 400, "seed"),
    (C, {"n": 0}, 400, "n"),
    (C, {"n": 17}, 400, "n"),
    (C, {"n": True}, 400, "n"),
    (C, {"logprobs": 50}, 400, "logprobs"),  # at most 20
    (C, {"presence_penalty": 5}, 400, "presence_penalty"),  # in [-2, 2]
    (C, {"stop": ""}, 400, "stop"),
    (C, {"stop": ["a"] * 17}, 400, "stop"),
    (C, {"stop": [1]}, 400, "stop"),
    (C, {"stream": "yes"}, 400, "stream"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": "   "}, 400, "prompt"),
    (C, {"prompt": "x" * 600}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [5, 100000]}, 400, "prompt"),
    (C, {"prompt": [5, -1]}, 400, "prompt"),
    (C, {"prompt": ["a", "b"]}, 400, "prompt"),
    (C, {"prompt": {"text": "a"}}, 400, "prompt"),
    (C, {"prompt": None}, 400, "prompt"),
    (C, {"method": "nope"}, 400, "method"),
    (C, {"method": 3}, 400, "method"),
    (C, {"model": "gpt-4"}, 404, "model"),
    (C, {"prompt": "x" * (70 << 10)}, 413, None),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": 2, "max_completion_tokens": 2}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "prompt": "x"}, 400, "prompt"),
]


@pytest.mark.parametrize(
    "route, body, status, param",
    BAD,
    ids=[f"{i}-{b if isinstance(b, bytes) else list(b)}"[:60] for i, (_, b, _, _) in enumerate(BAD)],
)
def test_bad_input_gets_its_error_and_the_next_request_succeeds(live, offline, route, body, status, param):
    client, _ = live
    if isinstance(body, bytes):
        r = client.post(route, content=body, headers={"content-type": "application/json"})
    else:
        good = {"messages": MSG, "temperature": 0} if route == CHAT else GOOD
        r = client.post(route, json={**good, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    r = client.post(C, json=GOOD)
    assert (
        r.status_code == 200
        and r.json()["choices"][0]["text"] == expect(offline, "Hello", max_new_tokens=2, temperature=0.0).text
    )


def test_unknown_route_and_verb_in_openai_format(live):
    client, _ = live
    for r, status in ((client.get("/v1/nothing"), 404), (client.get(C), 405), (client.delete("/v1/models"), 405)):
        assert r.status_code == status and r.json()["error"]["message"]
    assert client.get(C).headers["allow"] == "POST"


def test_bad_server_settings_are_refused(models):
    engine = Engine(*models)
    with pytest.raises(DraftVerifyError, match="unknown method 'nope'"):
        parse_methods("speculative,nope")
    with pytest.raises(DraftVerifyError, match="unclosed"):
        parse_methods("speculative[k=4")
    with pytest.raises(DraftVerifyError, match="unknown method 'hf-assisted'"):  # a bench peer, not a method
        parse_methods("hf-assisted")
    with pytest.raises(DraftVerifyError, match="listed twice"):
        parse_methods("autoregressive,autoregressive")
    with pytest.raises(DraftVerifyError, match="k=0 must lie"):
        create_app(engine, ServeConfig(methods=parse_methods("speculative[k=0]")))
    with pytest.raises(DraftVerifyError, match="needs a draft model"):
        create_app(Engine(models[0]), ServeConfig(methods=parse_methods("speculative")))
    with pytest.raises(DraftVerifyError, match="max_queue=-1"):
        ServeConfig(max_queue=-1)
    with pytest.raises(DraftVerifyError, match="exactly one loaded method with a pool"):
        create_app(engine, ServeConfig(methods=parse_methods("speculative"), pool_file="pool.json"))


def test_parse_methods():
    specs = parse_methods("speculative[k=4,policy=heuristic], autoregressive,speculative:k2")
    assert [(s.label, s.name, s.preset, dict(s.options)) for s in specs] == [
        ("speculative[k=4,policy=heuristic]", "speculative", None, {"k": 4, "policy": "heuristic"}),
        ("autoregressive", "autoregressive", None, {}),
        ("speculative:k2", "speculative", "k2", {}),
    ]


# -- the text stream -----------------------------------------------------------------------------


def test_text_stream_holds_back_stop_prefixes(tokenizer):
    ids = tokenizer("abcXYdefXYZghi")["input_ids"]
    stream = TextStream(tokenizer, ["XYZ"])
    deltas = [stream.push([t]) for t in ids]
    assert "".join(deltas) == "abcXYdef"  # "XY" waited until "d" showed it was no stop
    assert deltas[3] == deltas[4] == "" and deltas[5] == "XYd"
    assert stream.finish("abcXYdef") == ""


@pytest.mark.slow
def test_text_stream_adds_up_on_the_real_tokenizer(smollm):
    import random

    tok = smollm.tokenizer
    text = "Héllo wörld — 東京 🚀🎉 naïve café\n\tdef f(x): return x**2  # ok ✓"
    ids = tok(text)["input_ids"]
    rng = random.Random(0)
    for _ in range(20):
        stream, sent, i = TextStream(tok, ["x**", "🎉"]), "", 0
        while i < len(ids):
            n = rng.randint(1, 4)
            sent += stream.push(ids[i : i + n])
            i += n
        final = tok.decode(ids, skip_special_tokens=True)
        final = final[: min(final.find(s) for s in ["x**", "🎉"])]
        sent += stream.finish(final)
        assert sent == final


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


def wait_for(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_load_50_requests_8_clients_some_disconnecting(models, offline):
    """8 clients send 50 requests (both routes and methods, greedy and seeded sampling, streamed
    or not); every fifth request hangs up after its first streamed text. With room for 8 waiting
    requests nobody is refused; nothing fails; every answer equals offline generation; every
    hang-up cancels its (long) generation."""
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
    assert 0 not in expect(offline, "Hello", max_new_tokens=30, temperature=0.0, eos_token_id=[]).tokens
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

    def one(client: httpx.Client, k: dict) -> tuple[int, str]:
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

    def client_loop(mine: list[dict]) -> list[tuple[int, str]]:
        with httpx.Client(base_url=url, timeout=WAIT_S) as client:
            return [one(client, k) for k in mine]

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
