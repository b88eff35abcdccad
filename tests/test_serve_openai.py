"""What OpenAI clients send, through the `openai` client against a live server (tiny models): penalties,
logit_bias, min_p, logprobs (streamed too), response_format; llama-server's `timings`. Every answer
equals offline `Engine.generate` with the same settings, under speculation and without."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_constraints import FORMAT, SCHEMA
from test_serve import WAIT_S, serving, url_of

from draftverify import Engine

METHODS = "speculative[k=4],autoregressive"
MODEL = "tiny-llama-0"


@pytest.fixture(scope="module")
def engines(tiny):
    models = tiny("llama"), tiny("llama", seed=1, layers=2)
    return Engine(*models), Engine(*models)


@pytest.fixture(scope="module")
def api(engines):
    with serving(engines[0], METHODS) as (client, _):
        yield openai.OpenAI(base_url=f"{url_of(client)}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def offline(engines, prompt, method, max_new_tokens=24, **kwargs):
    options = {"k": 4} if method == "speculative" else {}
    return engines[1].generate(prompt, method=method, max_new_tokens=max_new_tokens, **options, **kwargs)


@pytest.mark.parametrize("method", ["speculative[k=4]", "autoregressive"])
def test_penalties_bias_and_min_p_equal_offline(api, engines, method):
    knobs = {"presence_penalty": 1.2, "frequency_penalty": 0.5, "logit_bias": {"7": 5.0}}
    out = api.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 1, 2,",
        max_tokens=24,
        temperature=0,
        extra_body={"method": method, "min_p": 0.1},
        **knobs,
    )
    want = offline(engines, "1, 2, 3, 1, 2,", "autoregressive", **knobs)
    assert out.choices[0].text == want.text
    plain = offline(engines, "1, 2, 3, 1, 2,", "autoregressive")
    assert plain.text != want.text, "the knobs change nothing here: the test could not fail"


def test_chat_logprobs_agree_between_methods_streamed_or_not(api):
    asked = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    a = api.chat.completions.create(extra_body={"method": "autoregressive"}, **asked)
    s = api.chat.completions.create(extra_body={"method": "speculative[k=4]"}, **asked)
    la, ls = a.choices[0].logprobs.content, s.choices[0].logprobs.content
    assert len(la) == len(ls) == a.usage.completion_tokens and len(la[0].top_logprobs) == 5
    assert [x.token for x in la] == [x.token for x in ls]
    assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(la, ls))
    assert "".join(x.token for x in la).startswith(a.choices[0].message.content)
    streamed = []
    for chunk in api.chat.completions.create(stream=True, extra_body={"method": "speculative[k=4]"}, **asked):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in ls]


def test_completion_logprobs_shape(api):
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(len(top) <= 3 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_json_schema_through_the_client(api, engines):
    for method in ("speculative[k=4]", "autoregressive"):
        out = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A person"}], max_tokens=100, temperature=0,
            response_format=FORMAT, extra_body={"method": method},
        )  # fmt: skip
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        want = offline(engines, [{"role": "user", "content": "A person"}], "autoregressive", max_new_tokens=100,
                       response_format=FORMAT)  # fmt: skip
        assert out.choices[0].message.content == want.text


def test_invalid_schema_is_a_400_naming_it(api):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], response_format=bad)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        api.completions.create(model=MODEL, prompt="Hi", presence_penalty=5)


def test_timings_in_llama_server_shape(api):
    raw = api.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    timings = json.loads(raw.text)["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] > 0
    assert timings["draft_n"] >= timings["draft_n_accepted"] >= 0 and timings["predicted_per_second"] > 0
