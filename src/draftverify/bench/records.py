"""`records.jsonl`, the resumable log of a bench run, and the order of its generations."""

from __future__ import annotations

import json
import os
from pathlib import Path

from draftverify.bench.report import jsonable
from draftverify.errors import DraftVerifyError, require
from draftverify.util import atomic_write


def schedule(prompt_ids: list[str], labels: list[str], repeats: int) -> list[tuple[str, int, str]]:
    """The order of the generations: prompt by prompt, repeat by repeat, every method in turn."""
    return [(p, r, label) for p in prompt_ids for r in range(repeats) for label in labels]


class RecordLog:
    """`records.jsonl`: a config line, then one JSON line per finished piece of work.

    Lines are appended and flushed as they come, so an interrupted run loses at most the
    generation in flight; a torn last line is dropped on resume.
    """

    def __init__(self, path: Path, config: dict, overwrite: bool = False):
        self.path = path
        self.generations: dict[tuple[str, int, str], dict] = {}
        self.contexts: dict[str, str] = {}
        self.oracles: dict[str, dict] = {}
        self.costs: dict | None = None
        if path.exists() and not overwrite:
            self._load(config)
        else:
            atomic_write(path, json.dumps({"type": "config", "config": config}) + "\n")

    def _load(self, config: dict) -> None:
        raw = self.path.read_bytes()
        good = raw[: raw.rfind(b"\n") + 1]  # drop a torn last line
        lines = good.decode().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        require(
            header.get("type") == "config", f"{self.path} is not a bench record file: pass another --out or --overwrite"
        )
        old = header["config"]
        if old != config:
            key = next(k for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k))
            raise DraftVerifyError(
                f"{self.path.parent} holds a run with another config ({key}: {_short(old.get(key))} there, "
                f"{_short(config.get(key))} now): pass another --out, or --overwrite to start over"
            )
        if len(good) != len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(len(good))
        for line in lines[1:]:
            self._index(json.loads(line))

    def _index(self, record: dict) -> None:
        kind = record["type"]
        if kind == "generation":
            self.generations[(record["prompt_id"], record["repeat"], record["label"])] = record
        elif kind == "context":
            self.contexts[record["prompt_id"]] = record["answer"]
        elif kind == "oracle":
            self.oracles[record["prompt_id"]] = record
        elif kind == "cost_model":
            self.costs = record["costs"]

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._index(record)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
