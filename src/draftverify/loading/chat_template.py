"""A chat template rendered as transformers renders it (`utils/chat_template_utils.py`), without transformers.

The same Jinja environment: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the loop
controls extension and a `{% generation %}` block (transformers' assistant tracker, here without the tracking that
only its masks use), its `tojson` filter (`json.dumps`, not HTML-escaped, non-ASCII kept) and its globals
`raise_exception`, `strftime_now`, `dict` and `namespace` (no underscore names). The messages as transformers
prepares them for the plain case: keys whose value is None dropped, the reasoning copied under its three names; the
template sees `messages`, `tools`, `documents` (None), `add_generation_prompt` and the special tokens by name, then
the caller's keyword arguments. Templates are compiled once each.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' `_REASONING_FIELDS`
_SCALARS = (str, int, float, bool, type(None))


def is_plain(value) -> bool:
    """Is `value` made of JSON's types only (exact str, int, float, bool, None, dict, list, tuple)? transformers
    rebuilds such data unchanged before a template sees it; anything else it converts (and is left to it)."""
    if type(value) in _SCALARS:
        return True
    if type(value) is dict:
        return all(type(k) in _SCALARS and is_plain(v) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(is_plain(v) for v in value)
    return False


def plain_messages(conversation) -> list[dict] | None:
    """One conversation's messages as transformers hands them to the template, or None when transformers would first
    convert something (message objects, a batch of conversations, values of other types)."""
    if type(conversation) is not list or not all(type(m) is dict for m in conversation) or not is_plain(conversation):
        return None
    messages = []
    for message in conversation:
        message = {key: _copy(value) for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def _copy(value):
    if type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy(v) for v in value)
    return value


def render(template: str, messages: list[dict], tools, add_generation_prompt: bool, variables: dict) -> str:
    """The text of `template` for `messages` (`plain_messages`' output), `tools` (JSON schemas or None) and the other
    template variables (the special tokens by name, then the caller's)."""
    tools = None if tools is None else [_copy(t) for t in tools]
    return compiled(template).render(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **{k: _copy(v) for k, v in variables.items()},
    )


@lru_cache(maxsize=16)
def compiled(template: str):
    """`template` compiled in transformers' environment (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` block: its body, as rendered."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict())
    env.globals["namespace"] = _namespace_class(jinja2)
    return env.from_string(template)


def _namespace_class(jinja2):
    """transformers' `namespace` of a template: Jinja's, refusing underscore names (no way to CPython's internals)."""

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    return TemplateNamespace
