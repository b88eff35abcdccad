"""llama-server compatibility (serve/llama.py) over real HTTP on 127.0.0.1: its request fields (n_probs honoured as
logprobs, cache_prompt and id_slot ignored; refused as unknown only with `strict`), /tokenize and /detokenize
round trips and /props on the real default model, and a chat template file used instead of the model's."""

from __future__ import annotations

import pytest
from test_serve import expect, serving
from typer.testing import CliRunner

from draftverify import DraftVerifyError, Engine
from draftverify.serve import ServeConfig, create_app, parse_methods

C = "/v1/completions"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }};{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def live(models):
    with serving(Engine(*models)) as (client, _):
        yield client


def test_llama_fields_accepted_and_ignored_unless_strict(live, models, offline):
    want = expect(offline, "Hello", max_new_tokens=6, temperature=0.0).text
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    llama = {"cache_prompt": True, "id_slot": 3}
    r = live.post(C, json={**body, **llama})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    r = live.post(C, json={**body, "temprature": 0.5})  # a typo is still refused: it would change the output
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field"
    r = live.post(C, json={**body, "cache_prompt": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_prompt"
    with serving(Engine(*models), strict=True) as (strict, _):
        for field, value in (*llama.items(), ("n_probs", 2)):
            r = strict.post(C, json={**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, field
        assert strict.post(C, json=body).json()["choices"][0]["text"] == want


def test_n_probs_is_honoured_as_logprobs(live):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    asked = live.post(C, json={**body, "n_probs": 3}).json()["choices"][0]["logprobs"]
    assert asked == live.post(C, json={**body, "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert len(asked["tokens"]) == 4 and all(len(top) == 3 for top in asked["top_logprobs"])
    assert live.post(C, json={**body, "n_probs": 0}).json()["choices"][0]["logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "n_probs": 2}
    content = live.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    r = live.post(C, json={**body, "n_probs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_probs"


def test_chat_template_file_is_used(models, offline, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    own = offline.encode(messages, chat=True)
    ids = offline.encode(messages, chat=True, chat_template=TEMPLATE)
    assert offline.target.tokenizer.decode(ids) == "[system] Be brief.;[user] hi;[assistant] " and ids != own
    want = offline.generate(ids, method="autoregressive", max_new_tokens=8, temperature=0.0)
    chat = {"messages": messages, "max_tokens": 8, "temperature": 0, "method": "autoregressive"}
    with serving(Engine(*models), chat_template=TEMPLATE) as (client, _):
        out = client.post("/v1/chat/completions", json=chat).json()
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["choices"][0]["message"]["content"] == want.text
        assert client.get("/props").json()["chat_template"] == TEMPLATE
    with pytest.raises(DraftVerifyError, match="the chat template does not render"):
        create_app(Engine(*models), ServeConfig(methods=parse_methods("autoregressive"), chat_template="{% if %}"))
    from draftverify.cli import app

    result = CliRunner().invoke(app, ["serve", "--chat-template", str(tmp_path / "none.jinja")])
    assert isinstance(result.exception, DraftVerifyError) and "--chat-template" in str(result.exception)


def test_tokenize_detokenize_and_props_bad_input(live):
    r = live.post("/tokenize", json={"content": "Hi", "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
    r = live.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert live.post("/tokenize", json={"content": ""}).json() == {"tokens": []}
    assert live.post("/detokenize", json={}).json() == {"content": ""}


@pytest.fixture(scope="module")
def real(smollm):
    with serving(Engine(smollm), "autoregressive", max_batch=4, default_max_tokens=64) as (client, _):
        yield client


@pytest.mark.slow
def test_tokenize_round_trip_on_the_real_model(real, smollm):
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # héllo ✓"
    tokens = real.post("/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == smollm.tokenizer(text, add_special_tokens=False)["input_ids"] and len(tokens) > 10
    assert real.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
    pieces = real.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == smollm.tokenizer("Hello world")["input_ids"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    r = real.post("/v1/completions", json={"prompt": tokens, "max_tokens": 2, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)  # the ids are what the model reads


@pytest.mark.slow
def test_props_on_the_real_model(real, smollm):
    props = real.get("/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["params"]["n_predict"] == 64
    assert props["default_generation_settings"]["n_ctx"] == Engine(smollm).target_runner.max_length
    assert props["chat_template"] == smollm.tokenizer.chat_template and "im_start" in props["chat_template"]
    assert props["model_path"].endswith(".gguf") and props["build_info"].startswith("draftverify ")
    assert props["methods"] == ["autoregressive"]
