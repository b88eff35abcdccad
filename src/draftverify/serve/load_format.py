"""`draftverify load --response-format FILE`: the OpenAI `response_format` every request of a run carries,
read from a JSON file, and the check of each output against it.

A json_object output is valid when it parses as a JSON object; a json_schema output when it parses and
validates against the schema (the `jsonschema` package, in the `serve` extra). Outputs under a regex or
Lark grammar are not checked here (valid is None: unknown, not 0). Under a grammar an output can still
be invalid: a reply cut at `--max-tokens` stops mid-object.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftverify.errors import DraftVerifyError, require

CHECKED = ("json_object", "json_schema")
EXAMPLE = "docs/examples/word-problem.json"


def read_response_format(path: Path) -> dict:
    """The `response_format` object held by the file at `path`, or a one-line error naming the file and the fix."""
    fix = f'give a JSON file holding an OpenAI response_format object, e.g. {{"type": "json_object"}} or {EXAMPLE}'
    try:
        value = json.loads(Path(path).read_text())
    except OSError as err:
        raise DraftVerifyError(f"cannot read --response-format {path}: {err.strerror}: {fix}") from None
    except ValueError as err:
        raise DraftVerifyError(f"cannot read --response-format {path}: not JSON ({err}): {fix}") from None
    require(
        isinstance(value, dict) and "type" in value, f"--response-format {path} holds no object with a 'type': {fix}"
    )
    if value["type"] == "json_schema":
        inner = value.get("json_schema")
        require(
            isinstance(inner, dict) and isinstance(inner.get("schema"), dict),
            f"--response-format {path}: json_schema needs {{'name': ..., 'schema': {{...}}}}: {fix}",
        )
    return value


def describe(response_format: dict | None) -> str | None:
    """A short name for the report: the type, and a json_schema's name."""
    if response_format is None:
        return None
    kind = response_format["type"]
    if kind == "json_schema":
        return f"json_schema `{response_format['json_schema'].get('name', '(unnamed)')}`"
    return kind


def output_valid(text: str, response_format: dict | None) -> bool | None:
    """Whether `text` parses as JSON (an object, for json_object) and validates against a json_schema's schema;
    None when no JSON format was sent (nothing to check)."""
    if response_format is None or response_format.get("type") not in CHECKED:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if response_format["type"] == "json_object":
        return isinstance(value, dict)
    import jsonschema

    try:
        jsonschema.validate(value, response_format["json_schema"]["schema"])
    except jsonschema.ValidationError:
        return False
    return True
