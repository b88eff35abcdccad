"""The OpenAI wire format: request models, errors, response bodies and stream chunks.

Requests are parsed strictly: a field of the wrong type, an unknown field (a typo such as
`temprature` would otherwise silently decode greedily), or an OpenAI field this server cannot
honour at a non-neutral value (`best_of=2`, `functions`...) is a 400 naming the field. Extensions: `method`
picks one of the server's loaded methods, `top_k` and `min_p` filter the sampling distribution,
`response_format` also takes {"type": "regex", "regex": ...} and {"type": "lark", "lark": ...}, and
every response carries a `draftverify` object with the request's speculative stats and llama-server's
`timings`. Chat's `tools`, `tool_choice`, `tool` messages and assistant `tool_calls`: serve/tools.py.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from draftverify.detokenize import Detokenizer
from draftverify.serve.api_error import ApiError
from draftverify.serve.llama_fields import llama_fields
from draftverify.stats import Stats

MIN_TEMPERATURE = 1e-6  # smaller positive temperatures overflow float32 logits (NaN); 0 means greedy
MAX_STOPS = 16
MAX_CHOICES = 16  # `n`: choices of one request, each a member of the batch
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # Stats.finish_reason -> OpenAI

# OpenAI fields the server accepts only at the value that changes nothing (clients often send them).
NEUTRAL = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "parallel_tool_calls": (None, True, False),
}
CHAT_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")  # chat takes them (serve/tools.py), completions not


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    tool_calls: list[dict] | None = None  # an assistant's calls (checked in serve/tools.py)
    tool_call_id: str | None = None  # a tool message's: the call it answers
    content: str | None = Field(None, validate_default=True)  # None only beside tool_calls
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content):
        """Content is a string or a list of text parts (joined); images and audio are refused."""
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                    and len(part) == 2
                ):
                    raise ValueError('only text parts are supported: send {"type": "text", "text": "..."}')
                texts.append(part["text"])
            return "".join(texts)
        return content

    @field_validator("content")
    @classmethod
    def _present(cls, content, info):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("Field required: give the message's text")
        return content


class Options(_Strict):
    provenance: bool = False  # stream chunks say who drafted each token (serve/provenance.py)


class _Common(_Strict):
    model: str | None = None
    method: str | None = None  # extension: which of the server's methods decodes this request
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # extension; 0 = off
    min_p: float = Field(0.0, ge=0, le=1)  # extension; 0 = off
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None  # text, json_object, json_schema; extensions regex, lark
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, decoded together as members of the batch (serve/choices.py)
    draftverify: Options | None = None  # extension: {"provenance": true}

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, t: float) -> float:
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"{t} is too small to sample with: use 0 for greedy decoding or at least {MIN_TEMPERATURE}"
            )
        return t

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop):
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise ValueError("give a non-empty string or a list of them")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops)} stop strings: give at most {MAX_STOPS}")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)  # the likeliest tokens to list beside each token's own

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        """One prompt: text or token ids, alone or as a batch of one."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            return prompt
        raise ValueError("give one prompt per request: a string or a list of token ids")


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None  # OpenAI function tools (serve/tools.py)
    tool_choice: str | dict | None = None  # "auto" (with tools), "none", "required" or {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: at most one call


def parse_request(raw: bytes, kind: str, strict: bool = True) -> CompletionRequest | ChatRequest:
    """The request body -> a validated request, or an ApiError(400) naming the field. Unless `strict`,
    llama-server's fields are accepted too (`llama_fields.llama_fields`)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}): send a JSON object", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if not strict:
        data = llama_fields(data, kind)
    for field, allowed in NEUTRAL.items():
        if field in data and not (kind == "chat" and field in CHAT_TOOLS):
            value = data.pop(field)
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise ApiError(
                    400,
                    f"{field}={json.dumps(value)} is not supported by this server: remove the field",
                    param=field,
                    code="unsupported_parameter",
                )
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc.errors()[0], model) from exc
    if kind == "chat" and request.max_tokens is not None and request.max_completion_tokens is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    return request


def _field_error(error: dict, model: type[BaseModel]) -> ApiError:
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    if error["type"] == "extra_forbidden":
        return ApiError(
            400,
            f"unknown field {param!r}: remove it (fields: {', '.join(sorted(model.model_fields))})",
            param=param,
            code="unknown_field",
        )
    message = error["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


# -- responses -----------------------------------------------------------------------------


class Reply:
    """The bodies of one response: whole (non-streamed) or as stream chunks."""

    def __init__(self, kind: str, model: str, tools=None):
        self.kind, self.model = kind, model
        self.tools = tools  # a chat reply's serve.tools.ToolPlan: its text read as content and tool calls
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": obj + (".chunk" if chunk and self.kind == "chat" else ""),
            "created": self.created,
            "model": self.model,
        }

    def choice(self, text: str, finish: str, logprobs: dict | None = None, index: int = 0) -> dict:
        """One choice of a whole (non-streamed) response."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.tools is not None:
                message, finish = self.tools.message(text, finish)
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, text: str, finish: str, usage: dict, stats: dict, logprobs: dict | None = None) -> dict:
        return self.whole_choices([self.choice(text, finish, logprobs)], usage, stats)

    def whole_choices(self, choices: list[dict], usage: dict, stats: dict) -> dict:
        """The response of `choices` (`choice`); `stats`, the first choice's, at the top (n = 1 as always)."""
        timings = stats.pop("timings", None)
        return {**self._head(False), "choices": choices, "usage": usage, "draftverify": stats, "timings": timings}

    def chunk(
        self,
        text: str | None = None,
        finish: str | None = None,
        first: bool = False,
        logprobs=None,
        index: int = 0,
        **extra,
    ) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(True), "choices": [choice], **extra}

    def usage_chunk(self, usage: dict, stats: dict) -> dict:
        return {**self._head(True), "choices": [], "usage": usage, "draftverify": stats}


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stats_object(stats: Stats, method: str, queue_s: float) -> dict:
    """The request's speculative stats as sent to the client (formulas in docs/metrics.md)."""
    out = stats.to_dict(timings=False)
    for name in ("steps", "finish_reason", "prompt_tokens"):
        out.pop(name)
    out["method"] = method
    out["queue_s"] = queue_s
    out["timings"] = timings(stats)
    return out


def timings(stats: Stats) -> dict:
    """llama-server's per-request `timings`: the prompt's forward (to the first token) and the rest."""
    prompt_ms = 1000 * (stats.ttft_s or 0.0)
    predicted_ms = max(1000 * stats.wall_s - prompt_ms, 0.0)
    predicted_n = stats.new_tokens  # as llama-server counts: every generated token, the first one included
    return {
        "prompt_n": stats.prompt_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / stats.prompt_tokens if stats.prompt_tokens else None,
        "prompt_per_second": 1000 * stats.prompt_tokens / prompt_ms if prompt_ms else None,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else None,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else None,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


class TextStream:
    """Text deltas of a growing token list, never to be taken back.

    Holds back a trailing incomplete UTF-8 character (decoded as U+FFFD) and any tail that
    could start a stop string, and cuts the text at the first stop string, so the deltas add up
    to exactly the text the non-streamed response returns (`Session.text`). The text comes from a
    `Detokenizer`, and stop strings are looked for only where one could start (no stop is in the
    text sent, nor straddles its end: that tail was held back), so a push costs the same at the
    thousandth token as at the first.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.stops = stops
        self.decoded = Detokenizer(tokenizer)
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        text = self.decoded.extend(tokens)
        hits = [i for s in self.stops if (i := text.find(s, len(self.sent))) >= 0]
        text = text[: min(hits, default=len(text))].rstrip("\ufffd")
        hold = max([n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
        return self._advance(text[: len(text) - hold])

    def finish(self, text: str) -> str:
        """The last delta, given the final text of the request."""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
