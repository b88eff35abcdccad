"""The one reader of prompt files, for every command that takes `--prompts` (the offline tools; the bench may use it).

A `.jsonl` file holds one JSON object per line with a "prompt" string and an optional "chat" bool (wrap the
prompt in the chat template); any other file holds one prompt per line, with `\\n` standing for a line break.
A malformed line is refused with a one-line error naming the file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftverify.errors import require

FORMS = ".jsonl with a prompt field (and optional chat: bool) or .txt, one per line"


def read_prompts(path: str | Path, chat: bool = True, at_least: int = 1) -> list[tuple[str, bool]]:
    """(prompt, chat) pairs of the file at `path`, in order; `chat` is the default of rows that do not say.
    Refuses a file with fewer than `at_least` prompts."""
    path = Path(path)
    require(path.is_file(), f"prompt file {path} does not exist: pass --prompts FILE ({FORMS})")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            require(
                isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip(),
                f"{path} line {number} is not a JSON object with a non-empty prompt field: fix or remove that line",
            )
            prompts.append((row["prompt"], bool(row.get("chat", chat))))
        else:
            prompts.append((line.replace("\\n", "\n"), chat))
    require(prompts, f"prompt file {path} holds no prompts: add some ({FORMS})")
    require(len(prompts) >= at_least, f"prompt file {path} holds {len(prompts)} prompts: this needs {at_least} or more")
    return prompts
