"""Spec-Bench answer files from a bench run, read the way Spec-Bench's own scripts read them:
`evaluation/speed.py` (per question sum(new_tokens) / sum(wall_time) of choice 0, speedup = the
ratio of the means over questions) and `evaluation/equal.py` (str(turns) of choice 0, line by line)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from draftverify import Engine
from draftverify.bench.datasets import Prompt
from draftverify.bench.runner import Bench, Settings
from draftverify.bench.specbench import file_name, question_of, write_answers
from draftverify.bench.specs import parse_specs

PROMPTS = [
    Prompt("sb/1", "sb", "writing", ("Hello there",), True),
    Prompt("sb/2#1", "sb", "math", ("abc abc",), True),
    Prompt("sb/2#2", "sb", "math", ("abc abc", "again"), True),
]


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    engine = Engine(tiny("llama"), tiny("llama", seed=1, layers=2))
    out = tmp_path_factory.mktemp("bench")
    specs = parse_specs("speculative[k=3],hf-prompt-lookup")
    results = Bench(engine, PROMPTS, specs, Settings(max_new_tokens=10, repeats=2), out).run(progress=False)
    decode = lambda tokens: engine.target.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    return results, write_answers(results, out / "spec-bench", decode), decode


def load(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def speed(lines):
    """speed.py's figure for a method file: the mean over questions of choice 0's tokens over its time."""
    return np.mean([sum(d["choices"][0]["new_tokens"]) / sum(d["choices"][0]["wall_time"]) for d in lines])


def test_answer_files_have_spec_bench_shape(run):
    results, paths, decode = run
    assert set(paths) == {"autoregressive", "speculative[k=3]", "hf-prompt-lookup"}
    assert (
        paths["speculative[k=3]"].name
        == file_name("tiny-llama-0-speculative[k=3]")
        == "tiny-llama-0-speculative-k-3.jsonl"
    )
    lines = load(paths["speculative[k=3]"])
    assert [d["question_id"] for d in lines] == ["sb/1", "sb/2"] and [d["category"] for d in lines] == [
        "writing",
        "math",
    ]
    two_turns = lines[1]
    assert set(two_turns) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
    assert [c["index"] for c in two_turns["choices"]] == [0, 1]  # one choice per repeat
    choice = two_turns["choices"][0]
    assert set(choice) == {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}
    records = {r["prompt_id"]: r for r in results["records"] if r["label"] == "speculative[k=3]" and r["repeat"] == 0}
    assert choice["turns"] == [decode(records["sb/2#1"]["tokens"]), decode(records["sb/2#2"]["tokens"])]
    assert choice["new_tokens"] == [records["sb/2#1"]["new_tokens"], records["sb/2#2"]["new_tokens"]]
    assert choice["wall_time"] == [records["sb/2#1"]["wall_s"], records["sb/2#2"]["wall_s"]]
    steps = records["sb/2#1"]["steps"] + records["sb/2#2"]["steps"]  # tokens per verification, bonus included
    assert choice["accept_lengths"] == steps and sum(steps) == sum(choice["new_tokens"]) - 2  # not the prefill's
    assert choice["decoding_steps"] == [records["sb/2#1"]["target_forwards"], records["sb/2#2"]["target_forwards"]]


def test_speed_and_equality_the_way_spec_bench_computes_them(run):
    results, paths, _ = run
    base = load(paths["autoregressive"])
    for label in ("speculative[k=3]", "hf-prompt-lookup"):
        lines = load(paths[label])
        # speed.py: the ratio of the mean speeds over questions, from the records of repeat 0
        per_question = {}
        for r in results["records"]:
            if r["repeat"] == 0 and r["label"] in (label, "autoregressive"):
                n, t = per_question.get((r["label"], question_of(r["prompt_id"])), (0, 0.0))
                per_question[(r["label"], question_of(r["prompt_id"]))] = (n + r["new_tokens"], t + r["wall_s"])
        mean = {
            x: np.mean([n / t for (lab, _), (n, t) in per_question.items() if lab == x])
            for x in (label, "autoregressive")
        }
        assert speed(lines) / speed(base) == pytest.approx(mean[label] / mean["autoregressive"])
        # equal.py: every line's str(turns) equal to the baseline's (greedy decoding is exact here)
        assert [str(d["choices"][0]["turns"]) for d in lines] == [str(d["choices"][0]["turns"]) for d in base]
