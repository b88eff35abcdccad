"""Method specs: the one grammar in which `generate`, `bench`, `serve` and `demo` name methods.

A spec is `name`, `name:preset`, `name[key=value,...]` or `name:preset[key=value,...]`, e.g.
`speculative`, `speculative:k2`, `lookahead:context`, `speculative[k=4,policy=heuristic]`.
Several specs are separated by commas; commas inside brackets belong to their spec. Values
are read as JSON where they parse (numbers, true/false), else kept as text; `-` in a key
becomes `_`. The spec string as written is its label, the name reports and clients use.

`read_spec` is the grammar alone (for callers with names of their own: the bench's peers);
`parse_spec` also checks the name against `METHODS` and builds the method's Config, so that a
bad spec is refused at once, in one line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from draftverify.errors import require
from draftverify.methods.base import METHODS, Drafts, Method

SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_\-]+)(?::(?P<preset>[A-Za-z0-9_\-.]+))?(?:\[(?P<options>[^\[\]]*)\])?$")
EXAMPLE = "speculative[k=4,policy=heuristic]"


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec string as written (stripped)
    name: str
    preset: str | None
    options: tuple[tuple[str, object], ...]  # explicit options, in the order written


def method_class(name: str) -> type[Method]:
    """The registered method `name`, or a one-line error listing the known ones."""
    require(name in METHODS, f"unknown method {name!r}: use one of {', '.join(sorted(METHODS))}")
    return METHODS[name]


def drafts_of(name: str, preset: str | None = None, options: dict | None = None) -> Drafts:
    """What method `name` with `preset` and `options` drafts with (`Method.drafts`). Options that are not its
    Config's are generation knobs (`generate`'s), left for `generate` to check."""
    cls = method_class(name)
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    return cls.drafts(cls.make_config(preset, **{k: v for k, v in (options or {}).items() if k in fields}))


def loads_drafts(specs: list[MethodSpec]) -> bool:
    """Whether the engine's default drafts (draft model, feature head) are worth loading for `specs`."""
    return any(drafts_of(s.name, s.preset, dict(s.options)).loads for s in specs)


def split_specs(text: str) -> list[str]:
    """'a,b[k=1,x=2],c' -> ['a', 'b[k=1,x=2]', 'c'] (commas inside brackets stay)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        require(depth in (0, 1), f"bad brackets in method specs {text!r}: write e.g. {EXAMPLE}")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    require(depth == 0, f"unclosed '[' in method specs {text!r}: write e.g. speculative[k=4]")
    parts.append(current.strip())
    return [p for p in parts if p]


def parse_value(text: str):
    """An option value: JSON where it parses (4, 0.5, true), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(pairs: list[str]) -> dict:
    """`key=value` strings (the `-o` flags) -> dict, values read by `parse_value`."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        require(sep and key, f"bad option {pair!r}: write key=value, e.g. -o k=4")
        options[key.replace("-", "_")] = parse_value(value)
    return options


def read_spec(text: str) -> MethodSpec:
    """One spec by the grammar alone: no check of the name or the options."""
    match = SPEC.match(text.strip())
    require(
        match is not None,
        f"bad method spec {text!r}: write name, name:preset, name[key=value,...] or name:preset[key=value]",
    )
    options = []
    for pair in (match["options"] or "").split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        require(sep and key.strip(), f"bad option {pair!r} in method spec {text!r}: write key=value")
        options.append((key.strip().replace("-", "_"), parse_value(value.strip())))
    return MethodSpec(text.strip(), match["name"], match["preset"], tuple(options))


def parse_spec(text: str) -> MethodSpec:
    """One spec of a registered method, its preset and options checked by building its Config."""
    spec = read_spec(text)
    method_class(spec.name).make_config(spec.preset, **dict(spec.options))
    return spec


def parse_specs(text: str) -> list[MethodSpec]:
    """Comma-separated specs of registered methods, each listed once."""
    specs = [parse_spec(part) for part in split_specs(text)]
    refuse_duplicates(specs)
    return specs


def refuse_duplicates(specs: list) -> None:
    labels = [s.label for s in specs]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    require(duplicate is None, f"method spec {duplicate!r} is listed twice: drop one")
