"""Tool calling the OpenAI way: `tools`, `tool_choice`, assistant `tool_calls` and `tool` messages.

The prompt: the tools and the history go through the model's chat template when it takes `tools` (Qwen2.5's
does); a template without them (SmolLM2's) gets the tools as a system block in the same Hermes format, the
history's calls as assistant text and the tool results as a user turn of `<tool_response>` blocks (`chat_prompt`).

The reply: the model calls a function by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
The request's grammar (`ToolPlan.grammar`, a Lark grammar through `constraints.Grammar` like any
response_format, so exact under speculation) makes every call well formed: the name one of the offered
functions, the arguments valid under that function's JSON schema. With `required` or a named function the
whole reply is calls (`required`: one or more, separated by a newline, unless `parallel_tool_calls` is false;
named: one); with `auto` the text is free until it writes `<tool_call>` (a lazy trigger), after which the call
is constrained, and any text may follow it. `none` shows the model no tools and constrains nothing.

`CallStream` reads the reply's text into content and calls, as it grows: streamed, it gives OpenAI's deltas;
whole, the same parse gives the message, so the deltas add up to it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from draftverify.errors import DraftVerifyError
from draftverify.serve.api_error import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD, CALL_TAIL = '\n{"name": ', "}\n"  # between the markers, around `"<name>", "arguments": <arguments>`
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Arguments as Python's json.dumps writes them (and the templates' `tojson`), the form the models were trained on.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# a call's start up to its arguments, read once their first character is there (so whitespace is not left over)
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _bad(message: str, param: str = "tools") -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class ToolPlan:
    """What a reply may call: `functions` name -> parameters schema; `required` (else auto); `parallel`: more
    than one call."""

    functions: dict
    required: bool
    parallel: bool
    tokens: bool = False  # `<tool_call>` and `</tool_call>` are special tokens of their own (Qwen2.5's), not text

    def grammar(self) -> str:
        """The Lark grammar of the reply (`%json` for each function's arguments)."""
        # a special token is named bare (`<tool_call>`: it is never text), text markers as string literals
        start, end = (OPEN, CLOSE) if self.tokens else (json.dumps(OPEN), json.dumps(CLOSE))
        lines = ["%llguidance {}"]
        if self.required:
            # a newline may end the reply, as the models end a call ("</tool_call>\n", then their end token)
            lines += [
                'start: call ("\\n" call)* "\\n"?' if self.parallel else 'start: call "\\n"?',
                f"call: {start} body",
            ]
        else:  # free text, then at `<tool_call>` (the first, lazily when it is text) the call
            lines += [
                "start: call* TEXT" if self.parallel else "start: TEXT | call",
                "TEXT: /(.|\\n)*/",
                f"trigger: TEXT {start}" if self.tokens else f"trigger[lazy]: TEXT {start}",
                "call: trigger body",
            ]
        names = " | ".join(f"fn_{i}" for i in range(len(self.functions)))
        lines.append(f"body: {json.dumps(CALL_HEAD)} ({names}) {json.dumps(CALL_TAIL)} {end}")
        for i, (name, schema) in enumerate(self.functions.items()):
            head = json.dumps(f'{json.dumps(name)}, "arguments": ')
            lines.append(f"fn_{i}: {head} %json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}")
        return "\n".join(lines)

    def response_format(self) -> dict:
        return {"type": "lark", "lark": self.grammar()}

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The whole reply's message and finish_reason ("tool_calls" when it called and ended by itself)."""
        calls = CallStream()
        calls.push(text)
        calls.finish()
        message = {"role": "assistant", "content": calls.content or None}
        if calls.calls:
            message["tool_calls"] = calls.calls
        return message, calls.finish_reason(finish)

    def stream(self) -> CallStream:
        return CallStream()


def tool_plan(req, engine) -> ToolPlan | None:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls` -> what its reply may call; None for a
    plain reply. Every tool is checked (a 400 naming it), offered or not."""
    functions = check_tools(req.tools or [], engine)
    tokens = marker_tokens(engine)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return None
    if not functions:
        raise _bad(f"tool_choice={json.dumps(choice)} needs tools: send the functions in `tools`", "tool_choice")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise _bad("give response_format or tools, not both: the calls have their own grammar", "response_format")
    if choice in ("auto", "required"):
        return ToolPlan(functions, choice == "required", req.parallel_tool_calls is not False, tokens)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise _bad(
            f'tool_choice={json.dumps(choice)} is not understood: give "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        raise _bad(
            f"tool_choice names {name!r}, which is not in tools: give one of {', '.join(functions)}", "tool_choice"
        )
    return ToolPlan({name: functions[name]}, True, False, tokens)


def marker_tokens(engine) -> bool:
    """Whether `<tool_call>` and `</tool_call>` are tokens of their own that llguidance reads as special (an
    added token is, as Qwen2.5's are): the grammar then names them as tokens, since no text matches them."""
    from draftverify.constraints import ll_tokenizer

    tok = engine.target.tokenizer
    ids = [tok.convert_tokens_to_ids(marker) for marker in (OPEN, CLOSE)]
    if not all(isinstance(i, int) and tok.convert_ids_to_tokens(i) == m for i, m in zip(ids, (OPEN, CLOSE))):
        return False
    lltok = ll_tokenizer(tok, engine.eos_ids())
    return all(i < lltok.vocab_size and lltok.is_special_token(i) for i in ids)


def check_tools(tools: list, engine) -> dict:
    """OpenAI tools -> {name: parameters schema}; a one-line 400 naming the first bad one."""
    from draftverify.constraints import Format, Grammar

    out = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
            raise _bad(f'{where} is not a function tool: give {{"type": "function", "function": {{"name": ...}}}}')
        name, schema = fn.get("name"), fn.get("parameters", NO_PARAMETERS)
        if not (isinstance(name, str) and NAME.fullmatch(name)):
            raise _bad(f"{where}.function.name is missing or not 1-64 letters, digits, _ or -: name the function")
        if name in out:
            raise _bad(f"{where}: two tools are named {name!r}: give each function its own name")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object: e.g. {{'type': 'object'}}")
        try:
            Grammar(Format("json_schema", schema), engine.target.tokenizer, engine.eos_ids())
        except DraftVerifyError as exc:
            raise _bad(f"{where}.function.parameters ({name}): {exc}") from exc
        out[name] = schema
    return out


# -- the prompt ------------------------------------------------------------------------------


def chat_prompt(req, template) -> tuple[list[dict], list[dict] | None]:
    """The request's messages (and tools) as the chat `template` (its text) takes them: (messages, tools or None)."""
    shown = req.tools if req.tools and req.tool_choice != "none" else None
    messages = [_entry(i, m) for i, m in enumerate(req.messages)]
    if isinstance(template, str) and "tools" in template:
        return messages, shown
    return hermes(messages, shown), None


def _entry(i: int, message) -> dict:
    """One message as a template reads it: an assistant's calls with their arguments parsed (templates write
    them with `tojson`); a tool message needs the id of the call it answers."""
    entry = message.model_dump(exclude_none=True)
    if message.role == "tool" and not message.tool_call_id:
        raise _bad(
            "a tool message needs tool_call_id: give the id of the call it answers", f"messages[{i}].tool_call_id"
        )
    if message.tool_calls is None:
        return entry
    where = f"messages[{i}].tool_calls"
    if message.role != "assistant":
        raise _bad("only assistant messages carry tool_calls: move them to an assistant message", where)
    calls = []
    for j, call in enumerate(message.tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name, arguments = (fn.get("name"), fn.get("arguments")) if isinstance(fn, dict) else (None, None)
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = None
        if not (isinstance(name, str) and isinstance(arguments, dict)):
            raise _bad(f"{where}[{j}] needs function.name and function.arguments (a JSON object's text)", where)
        calls.append({"id": call.get("id", ""), "type": "function", "function": {"name": name, "arguments": arguments}})
    entry["tool_calls"] = calls
    return entry


def call_text(name: str, arguments: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def hermes(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows no tools: the tools as a system block (Hermes, as Qwen2.5 writes it),
    an assistant's calls as its text, consecutive tool results as one user turn of `<tool_response>` blocks."""
    out = []
    if tools:
        block = TOOLS_BLOCK.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages[0]["role"] == "system":
            messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": block}, *messages]
    previous = None
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append(
                {"role": "assistant", "content": "\n".join(([m["content"]] if m.get("content") else []) + calls)}
            )
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
        previous = m["role"]
    return out


# -- the reply -------------------------------------------------------------------------------


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (to hold back until the next text)."""
    return max((n for n in range(1, len(marker)) if text.endswith(marker[:n])), default=0)


class CallStream:
    """A reply's text, pushed as it grows -> deltas: {"content": ...} and {"tool_calls": [...]} in OpenAI's shape.

    Content is the text outside the calls, without whitespace at its start, before a call or at its end. A call's
    id, type and name go out once its name is read, then its arguments as they come; a tail that could begin the
    call's end (`}` and `</tool_call>`) or a call's start is held until the next text shows what it is, so no
    delta is ever taken back. A call cut off (max_tokens) keeps the arguments it got; one whose name was never
    read is content, as written."""

    def __init__(self):
        self.buffer = ""  # text received, not yet settled
        self.content = ""  # content sent
        self.space = ""  # whitespace held at the end of the content
        self.calls: list[dict] = []
        self.open = False  # inside a call
        self.start = None  # where the open call's arguments start in `buffer`, once its name is read

    def push(self, text: str, final: bool = False) -> list[dict]:
        self.buffer += text
        out: list[dict] = []
        while self._call(out, final) if self.open else self._text(out, final):
            pass
        return out

    def finish(self) -> list[dict]:
        return self.push("", final=True)

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.calls and finish == "stop" else finish

    def _text(self, out: list[dict], final: bool) -> bool:
        at = self.buffer.find(OPEN)
        if at < 0:
            keep = 0 if final else _held(self.buffer, OPEN)
            self._say(self.buffer[: len(self.buffer) - keep], out, final)
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self._say(self.buffer[:at], out, True)
        self.buffer, self.open, self.start = self.buffer[at + len(OPEN) :], True, None
        return True

    def _say(self, text: str, out: list[dict], end: bool) -> None:
        text = self.space + text
        if not self.content:
            text = text.lstrip()
        said = text.rstrip()
        self.space = "" if end else text[len(said) :]
        if said:
            self.content += said
            out.append({"content": said})

    def _call(self, out: list[dict], final: bool) -> bool:
        at = self.buffer.find(CLOSE)
        body = self.buffer if at < 0 else self.buffer[:at]
        if self.start is None and (header := HEADER.match(body)):
            self.start = header.end()
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
            self.calls.append({**call, "function": {"name": header.group(1), "arguments": ""}})
            out.append(
                {"tool_calls": [{"index": len(self.calls) - 1, **call, "function": dict(self.calls[-1]["function"])}]}
            )
        if self.start is not None:
            self._arguments(body[self.start :], at >= 0, out)
        if at < 0 and not final:
            return False
        if self.start is None:  # not a call after all: its text is content
            self._say(OPEN + body + (CLOSE if at >= 0 else ""), out, False)
        self.buffer = self.buffer[at + len(CLOSE) :] if at >= 0 else ""
        self.open = False
        return at >= 0

    def _arguments(self, text: str, closed: bool, out: list[dict]) -> None:
        """Send the arguments read so far: all but a tail that may be the call's closing `}` (and its end)."""
        brace = text.rfind("}")
        if brace >= 0 and (closed or CLOSE.startswith(text[brace + 1 :].lstrip())):
            text = text[:brace].rstrip()
        function = self.calls[-1]["function"]
        if len(text) > len(function["arguments"]) and text.startswith(function["arguments"]):
            delta, function["arguments"] = text[len(function["arguments"]) :], text
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": delta}}]})


def stream_chunks(reply, index: int, deltas: list[dict], logprobs=None) -> list[dict]:
    """Stream chunks of `deltas` (a CallStream's), the chunk's logprobs on the first (or on an empty delta)."""
    chunks = []
    for delta in (deltas or [{}]) if logprobs is not None else deltas:
        chunk = reply.chunk(index=index, logprobs=None if chunks else logprobs)
        chunk["choices"][0]["delta"] = delta
        chunks.append(chunk)
    return chunks
