"""Spec-Bench's answer files from a bench run, so that its own scripts read our runs.

Spec-Bench (Xia et al. 2024, github.com/hemingkx/Spec-Bench) writes one JSONL file per method,
one line per question, each line holding the answers of every run ("choice") of that question:

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index", "turns": [answer text per turn], "decoding_steps": [per turn],
                  "new_tokens": [per turn], "wall_time": [seconds per turn],
                  "accept_lengths": [tokens emitted per target forward, over all turns]}]}

Its `evaluation/speed.py` takes, per question, sum(new_tokens) / sum(wall_time) of choice 0 for a
method and, for the baseline, the answer texts re-tokenized over sum(wall_time); the speedup is
the ratio of the two means over questions. Its `evaluation/equal.py` compares the `turns` of two
files line by line. Here a question is a prompt row (its turns are the bench's `#<turn>` prompts),
a choice is a repeat; figures a peer does not expose stay unknown: `decoding_steps` null and
`accept_lengths` empty.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable

from draftverify.util import atomic_write


def question_of(prompt_id: str) -> str:
    """The question a prompt belongs to: its id without the `#<turn>` suffix of multi-turn rows."""
    return prompt_id.rsplit("#", 1)[0]


def file_name(model_id: str) -> str:
    """A file name for a model id: characters other than letters, digits, `.`, `_` and `-` become `-`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model_id).strip("-") + ".jsonl"


def choice(index: int, records: list[dict], decode: Callable[[list[int]], str]) -> dict:
    """One choice: the records of one question's turns (in turn order) in one repeat."""
    steps = [r["steps"] for r in records]
    return {
        "index": index,
        "turns": [decode(r["tokens"]) for r in records],
        "decoding_steps": [r["target_forwards"] for r in records],
        "new_tokens": [r["new_tokens"] for r in records],
        "wall_time": [r["wall_s"] for r in records],
        "accept_lengths": [] if None in steps else [n for s in steps for n in s],
    }


def answers(records: list[dict], model_id: str, decode: Callable[[list[int]], str]) -> list[dict]:
    """One method's records as Spec-Bench answer lines, one per question, in the order the questions ran."""
    grouped: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        grouped.setdefault(question_of(r["prompt_id"]), {}).setdefault(r["repeat"], []).append(r)
    lines = []
    for question, repeats in grouped.items():
        choices = [
            choice(i, sorted(recs, key=lambda r: r["turn"]), decode)
            for i, (_, recs) in enumerate(sorted(repeats.items()))
        ]
        first = next(iter(repeats.values()))[0]
        lines.append(
            {
                "question_id": question,
                "category": first["category"],
                "answer_id": f"{model_id}/{question}",
                "model_id": model_id,
                "choices": choices,
                "tstamp": time.time(),
            }
        )
    return lines


def write_answers(results: dict, out_dir: Path, decode: Callable[[list[int]], str]) -> dict[str, Path]:
    """Write one answer file per method of a bench run (results.json's content) into `out_dir`.

    The model id of a method is `<target>-<label>`; returns label -> file path.
    """
    target = Path(results["config"]["target"]).stem
    paths = {}
    for method in results["methods"]:
        label = method["label"]
        model_id = f"{target}-{label}"
        lines = answers([r for r in results["records"] if r["label"] == label], model_id, decode)
        path = Path(out_dir) / file_name(model_id)
        atomic_write(path, "".join(json.dumps(line) + "\n" for line in lines))
        paths[label] = path
    return paths
