"""The server on the real default model (SmolLM2-135M-Instruct, static path), through the `openai` client
against `create_app(engine, methods auto,autoregressive)`: logprobs agree to the last bit, and a json_schema
answer validates and is token-identical between `auto` and `autoregressive`; `n: 3` gives plain decoding's answer."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_serve import WAIT_S, serving, url_of

from draftverify import Engine
from draftverify.loading import default_feature_head

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "hobbies"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
PERSON = [{"role": "user", "content": "Describe a person as JSON: name, age, favourite color and hobbies."}]


@pytest.fixture(scope="module")
def api(smollm):
    engine = Engine(smollm, feature_head=default_feature_head(smollm))
    assert engine.target_runner.backend == "static"
    with serving(engine, "auto,autoregressive") as (client, _):
        yield openai.OpenAI(base_url=f"{url_of(client)}/v1", api_key="unused", max_retries=0, timeout=10 * WAIT_S)


def ask(api, method: str, **kwargs):
    return api.chat.completions.create(model=None, temperature=0, extra_body={"method": method}, **kwargs)


def test_top_logprobs_agree_to_the_last_bit(api):
    # a reply that repeats the prompt: auto's lookups draft, and their rounds' logprobs are compared
    say = "Repeat after me three times: the quick brown fox jumps over the lazy dog."
    asked = dict(messages=[{"role": "user", "content": say}], max_tokens=48, logprobs=True)
    a = ask(api, "autoregressive", top_logprobs=5, **asked)
    s = ask(api, "auto", top_logprobs=5, **asked)
    la, ls = a.choices[0].logprobs.content, s.choices[0].logprobs.content
    assert len(la) == a.usage.completion_tokens and all(len(x.top_logprobs) == 5 for x in la)
    assert s.model_extra["draftverify"]["accepted"] > 0, "auto accepted no draft: the comparison proves nothing"
    assert [(x.token, x.bytes, x.logprob) for x in la] == [(x.token, x.bytes, x.logprob) for x in ls]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in la] == [
        [(t.token, t.logprob) for t in x.top_logprobs] for x in ls
    ]


def test_json_schema_validates_and_is_token_identical(api):
    outs = {
        m: ask(api, m, messages=PERSON, max_tokens=160, response_format=FORMAT, logprobs=True)
        for m in ("autoregressive", "auto")
    }
    for out in outs.values():
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    a, s = (outs[m].choices[0] for m in ("autoregressive", "auto"))
    assert a.message.content == s.message.content
    assert [x.bytes for x in a.logprobs.content] == [x.bytes for x in s.logprobs.content]  # token for token


def test_n_3_is_plain_decoding_thrice(api):
    plain = ask(api, "autoregressive", messages=PERSON, max_tokens=32)
    three = ask(api, "auto", messages=PERSON, max_tokens=32, n=3)
    assert [c.message.content for c in three.choices] == [plain.choices[0].message.content] * 3
