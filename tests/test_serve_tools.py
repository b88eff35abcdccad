"""Tool calling (serve/tools.py): `tools` and `tool_choice` through the chat template, the reply's calls
constrained by their JSON schemas (exact under speculation), read back as OpenAI `tool_calls`, whole or
streamed; the history's calls and tool results rendered; bad tools refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import make_tokenizer
from test_serve import WAIT_S, serving, url_of

from draftverify import Engine
from draftverify.constraints import Format, Grammar
from draftverify.serve.protocol import ChatRequest
from draftverify.serve.tools import CallStream, ToolPlan, chat_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
QWEN = Path("/work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def valid_calls(message) -> list[tuple[str, str]]:
    """The message's calls as (name, arguments), each checked against its function's schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def reassembled(chunks) -> tuple[list[dict], str, str]:
    """A stream's tool-call deltas put together by index -> (calls, content, finish_reason)."""
    calls, content, finish = {}, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function.name if d.function else None)
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], content, finish


# -- the reply's text as content and calls (no model) ------------------------------------------

REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Pa}ris"}}\n</tool_call>\n'
)


def test_call_stream_reads_the_same_however_the_text_is_cut():
    plan = ToolPlan(SCHEMAS, required=False, parallel=True)
    message, finish = plan.message(REPLY, "stop")
    assert message["content"] == "Let me check." and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"city": "Pa}ris"}),
    ]
    for size in (1, 2, 3, 7):
        stream, deltas = CallStream(), []
        for i in range(0, len(REPLY), size):
            deltas += stream.push(REPLY[i : i + size])
        deltas += stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        args = {}
        for d in deltas:
            for call in d.get("tool_calls", []):
                args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
        assert content == message["content"]
        assert [args[i] for i in sorted(args)] == [c["function"]["arguments"] for c in message["tool_calls"]]


def test_a_cut_off_call_keeps_what_it_got_and_plain_text_is_content():
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Par'
    message, finish = ToolPlan(SCHEMAS, True, False).message(cut, "length")
    assert finish == "length" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"city": "Par'}
    message, finish = ToolPlan(SCHEMAS, False, True).message("  No call <tool> here. ", "stop")
    assert message == {"role": "assistant", "content": "No call <tool> here."} and finish == "stop"


def test_auto_is_free_until_the_trigger_then_constrained():
    """The lazy trigger: before `<tool_call>` any character may follow; after it, only the call's own text."""
    tok = make_tokenizer()
    grammar = Grammar(Format("lark", ToolPlan(SCHEMAS, False, True).grammar()), tok, (0,))
    vocab = len(tok)

    def allowed_after(text: str) -> set[str]:
        ids = tok(text)["input_ids"]
        grammar.matcher.reset()
        grammar.consumed = 0
        row = grammar.allowed(ids, [[]], vocab)[0]
        return {tok.convert_ids_to_tokens(i) for i in range(vocab) if row[i]}

    free = allowed_after("Sure, let me look")
    assert {"a", "{", "<", "\n"} <= free
    assert allowed_after("Sure.<tool_call>") == {"\n"}
    assert allowed_after('Sure.<tool_call>\n{"name": "get_') == {"w", "t"}


def test_required_calls_may_end_after_a_newline_as_the_models_end_them():
    """After a whole call a newline may end the reply (Qwen2.5 writes `</tool_call>`, a newline, then its end
    token): the end token is allowed there, and with parallel calls another call too."""
    tok = make_tokenizer()
    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    for parallel in (True, False):
        grammar = Grammar(Format("lark", ToolPlan(SCHEMAS, True, parallel).grammar()), tok, (0,))
        row = grammar.allowed(tok(call + "\n")["input_ids"], [[]], len(tok))[0]
        assert row[0] and row[tok.convert_tokens_to_ids("<")] == parallel


@pytest.mark.slow
def test_marker_tokens_are_named_as_tokens():
    """Qwen2.5's `<tool_call>` and `</tool_call>` are added tokens, special to llguidance: no text matches them,
    so the grammar names them as tokens; the model's own marker token then opens and closes the call."""
    from types import SimpleNamespace

    from draftverify.loading import load_model
    from draftverify.serve.tools import marker_tokens

    tok = make_tokenizer()
    assert not marker_tokens(SimpleNamespace(target=SimpleNamespace(tokenizer=tok), eos_ids=lambda: (0,)))
    if not QWEN.exists():
        pytest.skip(f"{QWEN} is not here")
    qwen = load_model(QWEN, device="cpu")
    tok = qwen.tokenizer
    assert marker_tokens(SimpleNamespace(target=qwen, eos_ids=lambda: (151645,)))
    start, end = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    call = tok('\n{"name": "get_time", "arguments": {"city": "Rome"}}\n')["input_ids"]
    for required in (False, True):
        grammar = Grammar(Format("lark", ToolPlan(SCHEMAS, required, True, tokens=True).grammar()), tok, (151645,))
        prefix = [] if required else tok("Sure.")["input_ids"]
        assert grammar.allowed(prefix, [[]], len(tok))[0][start]
        after = grammar.allowed(prefix + [start], [[]], len(tok))[0]
        assert [tok.decode([i]) for i in range(len(tok)) if after[i]] == ["\n"]
        assert grammar.allowed(prefix + [start] + call, [[]], len(tok))[0][end]


def test_history_renders_through_qwens_template_and_as_hermes_text():
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]  # fmt: skip
    req = ChatRequest.model_validate({"messages": history, "tools": TOOLS})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    tok = make_tokenizer()  # a template without tools: the Hermes system block and text
    messages, shown = chat_prompt(req, tok.chat_template)
    assert shown is None and messages[0]["role"] == "system" and '"name": "get_time"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": call}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n21 C, sunny\n</tool_response>"}
    if not QWEN.exists():
        pytest.skip(f"{QWEN} is not here")
    from gguf import GGUFReader

    field = GGUFReader(QWEN).fields["tokenizer.chat_template"]
    tok.chat_template = bytes(field.parts[field.data[0]]).decode()
    messages, shown = chat_prompt(req, tok.chat_template)
    text = tok.apply_chat_template(messages, tools=shown, add_generation_prompt=True, tokenize=False)
    assert "# Tools" in text and '"name": "get_time"' in text
    assert call in text and "<tool_response>\n21 C, sunny\n</tool_response>" in text


# -- bad input (tiny models) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_api():
    """Tiny models whose template takes `tools` (as Qwen2.5's does) and writes them short: the character
    tokenizer's context has no room for the Hermes block."""
    from conftest import make_model

    from draftverify.loading import Loaded

    tok = make_tokenizer()
    tok.chat_template = "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}" + (
        tok.chat_template
    )
    target, draft = Loaded(make_model(), tok, name="tiny-tools"), Loaded(make_model(seed=1, layers=2), tok, name="d")
    with serving(Engine(target, draft)) as (client, _):
        yield client


NO_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [NO_SCHEMA]}, "tools", "tools[0].function.parameters (f)"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "not a function tool"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "not understood"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice", "not understood"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "not both"),
    ({"messages": ASK + [{"role": "tool", "content": "21 C"}]}, "messages[1].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user", "tool_calls": []}]}, "messages[0].content", "required"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[1].tool_calls", "arguments"),
]  # fmt: skip


@pytest.mark.parametrize("body, param, says", BAD, ids=[b[2] for b in BAD])
def test_bad_tools_get_a_one_line_400(tiny_api, body, param, says):
    r = tiny_api.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and "\n" not in error["message"]


def test_completions_still_refuse_tools(tiny_api):
    r = tiny_api.post("/v1/completions", json={"prompt": "Hi", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_tiny_named_call_is_token_identical_under_speculation(tiny_api):
    """A tiny random model with a tiny draft: the constrained call is the same under speculation."""
    outs = [
        tiny_api.post("/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 160, "temperature": 0, "method": method}).json()
        for method in ("speculative:k4", "autoregressive")
    ]  # fmt: skip
    (spec, plain) = (o["choices"][0] for o in outs)
    assert spec["finish_reason"] == "tool_calls" and outs[0]["draftverify"]["drafted"] > 0
    assert spec["message"]["tool_calls"][0]["function"] == plain["message"]["tool_calls"][0]["function"]
    arguments = json.loads(spec["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS["get_weather"])


# -- the default model, through the openai client ----------------------------------------------


@pytest.fixture(scope="module")
def api(smollm):
    with serving(Engine(smollm), "auto,autoregressive") as (client, _):
        yield openai.OpenAI(base_url=f"{url_of(client)}/v1", api_key="unused", max_retries=0, timeout=10 * WAIT_S)


def ask(api, method: str, **kwargs):
    return api.chat.completions.create(
        model=None, temperature=0, extra_body={"method": method}, **{"max_tokens": 48, **kwargs}
    )


@pytest.mark.slow
def test_required_calls_validate_and_are_identical_under_auto(api):
    outs = [ask(api, m, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
            for m in ("autoregressive", "auto")]  # fmt: skip
    for out in outs:
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert valid_calls(outs[0].choices[0].message) == valid_calls(outs[1].choices[0].message)
    assert outs[0].usage.completion_tokens == outs[1].usage.completion_tokens


@pytest.mark.slow
def test_named_choice_streamed_reassembles_to_the_whole_call(api):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = ask(api, "auto", messages=ASK, tools=TOOLS, tool_choice=named)
    assert [name for name, _ in valid_calls(whole.choices[0].message)] == ["get_time"]
    calls, content, finish = reassembled(ask(api, "auto", messages=ASK, tools=TOOLS, tool_choice=named, stream=True))
    assert finish == "tool_calls" and content == "" and calls[0]["id"].startswith("call_")
    assert [(c["name"], c["arguments"]) for c in calls] == valid_calls(whole.choices[0].message)


@pytest.mark.slow
def test_none_is_plain_content(api):
    plain = ask(api, "auto", messages=ASK, max_tokens=24)
    out = ask(api, "auto", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.slow
def test_history_with_calls_and_results_is_answered(api):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]  # fmt: skip
    outs = [ask(api, m, messages=history, tools=TOOLS, max_tokens=24) for m in ("autoregressive", "auto")]
    message = outs[0].choices[0].message
    assert message.content or message.tool_calls
    assert outs[1].choices[0].message.content == message.content
    assert outs[0].usage.prompt_tokens > ask(api, "auto", messages=ASK, max_tokens=1).usage.prompt_tokens + 50
