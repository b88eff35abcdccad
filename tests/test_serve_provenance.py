"""Provenance in the stream (`"draftverify": {"provenance": true}`, serve/provenance.py): each chunk says who
drafted each of its tokens, the tokens' texts add up to the content, and the content is the same as without it.
Tiny models; the target as its own draft accepts every drafted token, so the pattern of `by` is known exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_serve import serving, sse_events, streamed_text

from draftverify import Engine
from draftverify.drafters.auto import AutoDrafter, Round
from draftverify.drafters.auto_figures import Figures
from draftverify.drafters.base import Proposal, attribute
from draftverify.drafters.draft_model import DraftModel
from draftverify.drafters.prompt_lookup import PromptLookup, PromptLookupConfig
from draftverify.serve.provenance import Marks

METHODS = "speculative:k4,prompt-lookup,autoregressive,auto[use=draft+lookup],lookahead,ouroboros"
PROMPT = "Hello"  # the tiny target repeats one character: every token has text, prompt lookup copies it
MIXED = "1, 2, 3, 1, 2,"  # a reply with tokens of no text among the others


@pytest.fixture(scope="module")
def client(tiny):
    target = tiny("llama")
    with serving(Engine(target, target), METHODS) as (client, _):  # the target drafts for itself: all accepted
        yield client


def stream(client, method: str, provenance=True, kind="completions", prompt=PROMPT, **fields) -> list:
    body = {"max_tokens": 24, "temperature": 0, "stream": True, "method": method, **fields}
    body.update({"prompt": prompt} if kind == "completions" else {"messages": [{"role": "user", "content": prompt}]})
    if provenance:
        body["draftverify"] = {"provenance": True}
    with client.stream("POST", f"/v1/{kind}", json=body) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response)


def marked(events: list) -> list[dict]:
    return [t for e in events if isinstance(e, dict) and "x_draftverify" in e for t in e["x_draftverify"]["tokens"]]


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_the_tokens_texts_add_up_to_the_same_content(client, kind):
    events = stream(client, "speculative:k4", kind=kind, prompt=MIXED)
    text = streamed_text(events)
    assert text and "".join(t["text"] for t in marked(events)) == text
    assert streamed_text(stream(client, "speculative:k4", provenance=False, kind=kind, prompt=MIXED)) == text
    for event in events:  # every chunk's tokens are that chunk's text
        if isinstance(event, dict) and "x_draftverify" in event:
            choice = event["choices"][0]
            delta = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
            assert "".join(t["text"] for t in event["x_draftverify"]["tokens"]) == delta


def test_drafted_and_accepted_tokens_name_their_drafter_the_target_its_own(client):
    events = stream(client, "speculative:k4")
    by = [t["by"] for t in marked(events)]
    # the prefill's token, then rounds of four accepted drafted tokens and the target's bonus token
    assert by[:11] == [None] + ["draft-model"] * 4 + [None] + ["draft-model"] * 4 + [None]
    last = [e["x_draftverify"] for e in events if isinstance(e, dict) and "x_draftverify" in e][-1]
    stats = next(e["draftverify"] for e in events if isinstance(e, dict) and e.get("draftverify"))
    assert last["accepted"] == stats["accepted"] == by.count("draft-model")
    assert last["drafted"] == stats["drafted"] and last["target_forwards"] == stats["target_forwards"]
    assert last["new_tokens"] == stats["new_tokens"] == len(by)
    assert set(t["by"] for t in marked(stream(client, "autoregressive"))) == {None}


def test_prompt_lookup_names_itself_on_a_repeating_reply(client):
    method = "prompt-lookup"
    events = stream(client, method)
    by = [t["by"] for t in marked(events)]
    stats = next(e["draftverify"] for e in events if isinstance(e, dict) and e.get("draftverify"))
    assert stats["accepted"] > 0, "nothing was accepted: the test could not tell drafted tokens from the target's"
    assert set(by) == {None, "prompt-lookup"} and by.count("prompt-lookup") == stats["accepted"]
    assert streamed_text(events) == streamed_text(stream(client, method, provenance=False))


def test_auto_names_the_candidates_that_drafted(client):
    events = stream(client, "auto[use=draft+lookup]")  # which candidates draft is auto's choice, by its prices
    by = [t["by"] for t in marked(events)]
    stats = next(e["draftverify"] for e in events if isinstance(e, dict) and e.get("draftverify"))
    assert set(by) <= {None, "prompt-lookup", "draft-model"} and len(by) - by.count(None) == stats["accepted"]
    assert streamed_text(events) == streamed_text(stream(client, "autoregressive", provenance=False))


@pytest.mark.parametrize(
    "method, drafters", [("lookahead", {"lookahead"}), ("ouroboros", {"draft-model", "phrase-pool"})]
)
def test_every_accepted_token_has_its_drafter(client, method, drafters):
    events = stream(client, method, prompt=MIXED)
    by = [t["by"] for t in marked(events)]
    stats = next(e["draftverify"] for e in events if isinstance(e, dict) and e.get("draftverify"))
    assert set(by) - {None} <= drafters and len(by) - by.count(None) <= stats["accepted"]
    assert streamed_text(events) == streamed_text(stream(client, method, provenance=False, prompt=MIXED))


def test_auto_sources_are_its_chosen_candidates():
    auto = AutoDrafter({"draft": DraftModel(None, None), "lookup": PromptLookup(PromptLookupConfig())}, {}, Figures())
    step = SimpleNamespace(tokens=[1, 2, 9], accepted=2)
    for chosen, label in (("lookup", "prompt-lookup"), ("draft", "draft-model")):
        auto.round = Round({}, chosen=chosen, proposal=Proposal([[1, 2, 3]]))
        assert auto.sources(Proposal([[1, 2, 3]]), step) == [label, label]


def test_a_stop_string_cuts_the_marked_text_too(client):
    plain = streamed_text(stream(client, "speculative:k4", max_tokens=40, prompt=MIXED))
    stop = plain[len(plain) // 2 : len(plain) // 2 + 2]
    events = stream(client, "speculative:k4", max_tokens=40, prompt=MIXED, stop=[stop])
    text = streamed_text(events)
    assert text == plain[: plain.index(stop)] and "".join(t["text"] for t in marked(events)) == text


def test_provenance_needs_a_stream(client):
    body = {"prompt": PROMPT, "max_tokens": 4, "draftverify": {"provenance": True}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and "stream: true" in response.json()["error"]["message"]
    bad = client.post("/v1/completions", json={**body, "stream": True, "draftverify": {"provenance": "yes"}})
    assert bad.status_code == 400


class Chars:
    """A tokenizer whose tokens are bytes: a character of several bytes takes several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_marks_give_a_character_to_the_token_that_completes_it():
    marks = Marks(Chars())
    ids = list("aé".encode())  # a, then é's two bytes
    marks.push(ids, {"by": [None, "prompt-lookup", None], "drafted": 1, "accepted": 1, "target_forwards": 2})
    out = marks.take("aé")["x_draftverify"]
    assert out["tokens"] == [{"text": "a", "by": None}, {"text": "é", "by": None}] and out["accepted"] == 1


def test_attribute_names_the_part_whose_paths_hold_each_token():
    parts = [("feature-head", [[1, 2, 3]]), ("prompt-lookup", [[1, 2, 9, 9], [5]])]
    assert attribute([1, 2, 9], parts) == ["feature-head", "feature-head", "prompt-lookup"]
    assert attribute([5], parts) == ["prompt-lookup"] and attribute([], parts) == []
