"""Prompt sets: the benchmark files in the shared data folder, and user JSONL files.

Each row becomes one or more `Prompt`s. A prompt is a list of user turns and is benchmarked
on its last turn; the answers to the earlier turns are filled in by the runner (greedy
autoregressive decoding, the same for every method). Spec-Bench's and MT-Bench's two-turn
rows therefore give two prompts: turn 1, and turn 2 after the answer to turn 1
(`turns="first"` keeps turn 1 only).

| name | file | categories | format |
|---|---|---|---|
| spec_bench | spec_bench/question.jsonl | multi_turn, translation, summarization, qa, math_reasoning, rag | chat |
| mt_bench | mt_bench/question.jsonl | writing, roleplay, reasoning, math, coding, extraction, stem, humanities | chat |
| humaneval | humaneval/HumanEval.jsonl.gz | humaneval | raw completion of `prompt` |
| gsm8k | gsm8k/gsm8k_test_first300.jsonl | gsm8k | chat |
| cnn_dailymail | cnn_dailymail/cnndm_test_specbench80.jsonl | cnn_dailymail | chat |
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from draftverify.errors import DraftVerifyError, require

DATA_DIR_ENV = "DRAFTVERIFY_DATA_DIR"
# Spec-Bench's first 80 rows are MT-Bench's 80 questions, labelled with MT-Bench's 8
# categories; Spec-Bench reports them as one task, "multi-turn conversation".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TURNS = ("all", "first")


@dataclass(frozen=True)
class Prompt:
    id: str  # "<dataset>/<row id>", plus "#<turn>" for multi-turn rows
    dataset: str
    category: str
    turns: tuple[str, ...]  # user turns; the benchmarked one is the last
    chat: bool  # send through the chat template (False: raw completion of the single turn)

    @property
    def turn(self) -> int:
        return len(self.turns)


def category_key(dataset: str, category: str) -> str:
    """How a category is named in reports: `dataset/category`, or the data set alone when they agree."""
    return dataset if dataset == category else f"{dataset}/{category}"


def resolve_data_dir(option: str | Path | None, cwd: Path | None = None) -> Path:
    """--data-dir, else $DRAFTVERIFY_DATA_DIR, else the first existing of <cwd>/../shared/data
    and <repo root>/../shared/data."""
    if option is not None:
        path = Path(option)
        require(
            path.is_dir(), f"--data-dir {path} is not a folder: pass the folder that holds spec_bench/, humaneval/, ..."
        )
        return path
    if os.environ.get(DATA_DIR_ENV):
        path = Path(os.environ[DATA_DIR_ENV])
        require(path.is_dir(), f"${DATA_DIR_ENV}={path} is not a folder: fix it or pass --data-dir")
        return path
    repo_root = Path(__file__).resolve().parents[3]
    for path in ((cwd or Path.cwd()) / ".." / "shared" / "data", repo_root / ".." / "shared" / "data"):
        if path.is_dir():
            return path.resolve()
    raise DraftVerifyError(f"no benchmark data folder found: pass --data-dir DIR (or set ${DATA_DIR_ENV})")


def _jsonl(path: Path) -> list[dict]:
    require(path.is_file(), f"data file {path} is missing: pass the right --data-dir")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DraftVerifyError(
                        f"{path} line {n} is not valid JSON ({exc.msg}): fix or replace the file"
                    ) from exc
    return rows


def _question_rows(path: Path, dataset: str, merge_mt_bench: bool) -> list[tuple[str, str, tuple[str, ...], bool]]:
    rows = []
    for r in _jsonl(path):
        category = "multi_turn" if merge_mt_bench and r["category"] in MT_BENCH_CATEGORIES else r["category"]
        rows.append((str(r["question_id"]), category, tuple(r["turns"]), True))
    return rows


def _prompt_rows(path: Path, category: str, id_field: str, chat: bool) -> list[tuple[str, str, tuple[str, ...], bool]]:
    return [(str(r[id_field]), category, (r["prompt"],), chat) for r in _jsonl(path)]


# name -> rows (row id, category, user turns, chat)
DATASETS = {
    "spec_bench": lambda d: _question_rows(d / "spec_bench" / "question.jsonl", "spec_bench", merge_mt_bench=True),
    "mt_bench": lambda d: _question_rows(d / "mt_bench" / "question.jsonl", "mt_bench", merge_mt_bench=False),
    "humaneval": lambda d: _prompt_rows(d / "humaneval" / "HumanEval.jsonl.gz", "humaneval", "task_id", chat=False),
    "gsm8k": lambda d: _prompt_rows(d / "gsm8k" / "gsm8k_test_first300.jsonl", "gsm8k", "id", chat=True),
    "cnn_dailymail": lambda d: _prompt_rows(
        d / "cnn_dailymail" / "cnndm_test_specbench80.jsonl", "cnn_dailymail", "id", chat=True
    ),
}


def user_rows(path: Path) -> list[tuple[str, str, tuple[str, ...], bool]]:
    """A user JSONL file: one object per line with a `prompt` string; optional `id` and `category`."""
    rows = []
    for n, r in enumerate(_jsonl(path), 1):
        require(
            isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["prompt"].strip(),
            f'{path} line {n} has no non-empty "prompt" string: write one JSON object per line with a "prompt" field',
        )
        rows.append((str(r.get("id", n)), str(r.get("category", path.stem)), (r["prompt"],), True))
    return rows


def select(rows: list, limit: int | None, per_category: int | None) -> list:
    """The first `per_category` rows of each category (file order), then the first `limit` of those."""
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for row in rows:
            seen[row[1]] = seen.get(row[1], 0) + 1
            if seen[row[1]] <= per_category:
                kept.append(row)
        rows = kept
    return rows if limit is None else rows[:limit]


def load_prompts(
    datasets: list[str],
    data_dir: Path | None = None,
    prompts_file: Path | None = None,
    limit: int | None = None,
    per_category: int | None = None,
    turns: str = "all",
) -> list[Prompt]:
    """The prompts of the named data sets (from `data_dir`) and of a user JSONL file, in that order.

    `limit` and `per_category` apply to each data set separately and count rows (a two-turn
    row gives two prompts when `turns="all"`).
    """
    require(turns in TURNS, f"--turns {turns!r} is unknown: use all or first")
    require(limit is None or limit >= 1, f"--limit {limit} must be at least 1")
    require(per_category is None or per_category >= 1, f"--per-category {per_category} must be at least 1")
    for name in datasets:
        require(name in DATASETS, f"unknown data set {name!r}: use {', '.join(DATASETS)} or --prompts FILE.jsonl")
    require(datasets or prompts_file, "no prompts: pass --datasets NAMES and/or --prompts FILE.jsonl")
    sources = [(name, DATASETS[name](data_dir)) for name in datasets]
    if prompts_file is not None:
        sources.append((Path(prompts_file).stem, user_rows(Path(prompts_file))))
    prompts = []
    for dataset, rows in sources:
        for row_id, category, user_turns, chat in select(rows, limit, per_category):
            last = len(user_turns) if turns == "all" else 1
            for t in range(1, last + 1):
                suffix = f"#{t}" if len(user_turns) > 1 else ""
                prompts.append(Prompt(f"{dataset}/{row_id}{suffix}", dataset, category, tuple(user_turns[:t]), chat))
    return prompts
