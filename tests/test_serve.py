"""`draftverify serve` over real HTTP on 127.0.0.1 (uvicorn in a thread, tiny models): outputs equal
offline `Engine.generate`, streamed or not; bad input gets its OpenAI-format 4xx and harms nothing. Under load,
timeouts and shutdown: test_serve_load.py; the shared server and helpers: serving.py."""

from __future__ import annotations

import pytest
from serving import (  # noqa: F401  (other tests import these from here)
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
)

from draftverify import DraftVerifyError, Engine
from draftverify.serve import ServeConfig, create_app, parse_methods
from draftverify.serve.protocol import TextStream


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


# -- bad input ----------------------------------------------------------------------------------

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
