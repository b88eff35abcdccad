"""`n` > 1 in the server (serve/choices.py): the choices decode as members of one batch, and choice i equals the
same request decoded alone with seed `seed + i` (greedy: every choice is the greedy answer)."""

from __future__ import annotations

import pytest
from test_serve import expect, serving, sse_events

from draftverify import Engine

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def live(models):
    with serving(Engine(*models), max_body_bytes=64 << 10) as (client, server):
        yield client, server


def body_for(kind: str, **fields) -> dict:
    prompt = {"messages": [{"role": "user", "content": "Hi there"}]} if kind == "chat" else {"prompt": "Hi there"}
    return {**prompt, "max_tokens": 10, **fields}


def wants(offline, kind: str, n: int, method: str, sampling: dict) -> list:
    prompt = [{"role": "user", "content": "Hi there"}] if kind == "chat" else "Hi there"
    seed = sampling.get("seed")
    return [
        expect(offline, prompt, method, chat=kind == "chat", max_new_tokens=10, **{**sampling, "seed": seed + i})
        if seed is not None
        else expect(offline, prompt, method, chat=kind == "chat", max_new_tokens=10, **sampling)
        for i in range(n)
    ]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 30, "seed": 5}])
def test_n_choices_equal_their_requests_alone(live, offline, kind, sampling):
    client, _ = live
    # A sampled choice draws its seed's random numbers per draft length, and in a batch the cost policy prices drafts
    # by the rows they add to the shared forward: token-equal to decoding alone where draft lengths are the same
    # (greedy: always; sampling: autoregressive, or a constant draft length, as speculative:k4's), exactly
    # distributed everywhere.
    method = "speculative:k4"
    want = wants(offline, kind, 3, method, sampling)
    r = client.post(ROUTES[kind], json=body_for(kind, n=3, method=method, **sampling))
    assert r.status_code == 200, r.text
    out = r.json()
    texts = [c["message"]["content"] if kind == "chat" else c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert texts == [w.text for w in want]
    if sampling["temperature"]:
        assert len(set(texts)) > 1  # the seeds differ: a rule that reused one seed would give one text thrice
    assert out["usage"]["completion_tokens"] == sum(len(w.tokens) for w in want)
    assert out["usage"]["prompt_tokens"] == len(want[0].prompt_tokens)
    assert [c["draftverify"]["new_tokens"] for c in out["choices"]] == [len(w.tokens) for w in want]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_choices_streamed(live, offline, kind):
    client, _ = live
    sampling = {"temperature": 0.8, "seed": 21}
    want = wants(offline, kind, 2, "autoregressive", sampling)
    body = body_for(kind, n=2, method="autoregressive", stream=True, stream_options={"include_usage": True})
    with client.stream("POST", ROUTES[kind], json={**body, **sampling}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    per_choice = {0: "", 1: ""}
    finished = set()
    for event in events[:-1]:
        for c in event["choices"]:
            per_choice[c["index"]] += c["delta"].get("content", "") if kind == "chat" else c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert per_choice == {0: want[0].text, 1: want[1].text} and finished == {0, 1}
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == sum(len(w.tokens) for w in want)


def test_n_choices_decode_as_one_batch(models, monkeypatch):
    """The choices are members of one batch: the scheduler steps them together, one target forward for all."""
    from draftverify.batch import Batch

    sizes, step = [], Batch.step
    monkeypatch.setattr(Batch, "step", lambda self: sizes.append(len(self)) or step(self))
    with serving(Engine(*models), max_body_bytes=64 << 10) as (client, _):
        r = client.post("/v1/completions", json=body_for("completion", n=4, temperature=0.0, max_tokens=24))
        assert r.status_code == 200 and len({c["text"] for c in r.json()["choices"]}) == 1  # greedy: one answer
    assert max(sizes) == 4


def test_n_choices_that_do_not_fit_the_line_are_refused_whole(models):
    with serving(Engine(*models), max_body_bytes=64 << 10, max_queue=2) as (client, _):
        r = client.post("/v1/completions", json=body_for("completion", n=3, temperature=0.0))
        assert r.status_code == 429 and "fewer choices" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json=body_for("completion", n=2, temperature=0.0)).status_code == 200
