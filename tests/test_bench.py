"""The benchmark's pure parts: metric formulas on hand-made records, the exactness check, the
oracle and its cost model, the interleaving order, method specs, and the prompt sets."""

from __future__ import annotations

import json
import math

import pytest

from draftverify.bench import metrics
from draftverify.bench.datasets import DATASETS, load_prompts, resolve_data_dir, select
from draftverify.bench.oracle import ceiling_times, chain_factor, oracle_rounds, oracle_times
from draftverify.bench.records import RecordLog, schedule
from draftverify.bench.specs import PEERS, AssistedConfig, HfPromptLookupConfig, entry, names, parse_specs
from draftverify.costs import forward_time
from draftverify.drafters.prompt_lookup import PromptLookupConfig
from draftverify.errors import DraftVerifyError
from draftverify.methods import METHODS
from draftverify.methods.spec import split_specs
from draftverify.methods.speculative import SpeculativeConfig


def rec(
    label,
    prompt,
    repeat,
    wall,
    tokens=10,
    target=10,
    draft=0,
    drafted=0,
    accepted=0,
    draft_s=0.0,
    verify_s=None,
    ttft=0.1,
    times=None,
    toks=None,
    mem=100,
):
    return {
        "label": label,
        "prompt_id": prompt,
        "repeat": repeat,
        "wall_s": wall,
        "new_tokens": tokens,
        "target_forwards": target,
        "draft_forwards": draft,
        "drafted": drafted,
        "accepted": accepted,
        "draft_s": draft_s,
        "verify_s": wall * 0.5 if verify_s is None else verify_s,
        "ttft_s": ttft,
        "token_times": times if times is not None else [0.1 * (i + 1) for i in range(tokens)],
        "tokens": toks if toks is not None else list(range(tokens)),
        "steps": [],
        "peak_mem_bytes": mem,
    }


def hand_made():
    """Two prompts, two repeats; the method M is 2x and 4x faster on p1 and p2 in repeat 0, 1x and 4x in repeat 1."""
    records = []
    for r, (m1, m2) in enumerate(((1.0, 0.5), (2.0, 0.5))):
        records += [rec("AR", "p1", r, 2.0), rec("AR", "p2", r, 2.0)]
        records += [
            rec(
                "M",
                "p1",
                r,
                m1,
                target=4,
                draft=12,
                drafted=12,
                accepted=6,
                draft_s=0.25 * m1,
                verify_s=0.5 * m1,
                ttft=0.2,
                times=[0.2, 0.2, 0.2, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 1.0],
                mem=300,
            ),
            rec(
                "M",
                "p2",
                r,
                m2,
                target=5,
                draft=10,
                drafted=10,
                accepted=5,
                draft_s=0.25 * m2,
                verify_s=0.5 * m2,
                ttft=0.4,
                times=[0.4] * 10,
                mem=200,
            ),
        ]
    return records


def test_metric_formulas_on_hand_made_records():
    summary = metrics.summarize(hand_made(), "AR")
    m = summary["M"]
    # speedup: geomean of (2/1, 2/0.5) = sqrt(8) in repeat 0, geomean of (2/2, 2/0.5) = 2 in repeat 1
    assert m["speedup"]["median"] == pytest.approx((math.sqrt(8) + 2) / 2)
    assert m["speedup"]["min"] == pytest.approx(2.0) and m["speedup"]["max"] == pytest.approx(math.sqrt(8))
    # total-time speedup: 4 / 1.5 and 4 / 2.5
    assert (m["total_speedup"]["min"], m["total_speedup"]["max"]) == pytest.approx((4 / 2.5, 4 / 1.5))
    # decode-only: the time after the first token, AR 2.0 - 0.1 on both prompts; M 1.0 - 0.2 and 0.5 - 0.4
    # in repeat 0, 2.0 - 0.2 and 0.5 - 0.4 in repeat 1
    decode = [math.sqrt(1.9 / 1.8 * 1.9 / 0.1), math.sqrt(1.9 / 0.8 * 1.9 / 0.1)]  # min, max
    assert (m["decode_speedup"]["min"], m["decode_speedup"]["max"]) == pytest.approx(decode)
    assert m["decode_speedup"]["median"] > m["speedup"]["median"]  # M's prefill is slower than AR's
    assert m["tokens_per_s"]["max"] == pytest.approx(20 / 1.5)
    assert m["tokens_per_target_forward"]["median"] == pytest.approx(20 / 9)  # bonus tokens included
    assert m["acceptance_rate"]["median"] == pytest.approx(11 / 22)
    assert m["target_forwards_per_token"]["median"] == pytest.approx(9 / 20)
    assert m["draft_forwards_per_token"]["median"] == pytest.approx(22 / 20)
    assert m["discarded_per_token"]["median"] == pytest.approx(11 / 20)
    assert (m["draft_share"]["median"], m["verify_share"]["median"], m["other_share"]["median"]) == pytest.approx(
        (0.25, 0.5, 0.25)
    )
    assert m["ttft_p50_s"]["median"] == pytest.approx(0.3)
    # latency: gaps of p1 are 0,0,.3,0,0,.4,0,0,.1 and of p2 nine zeros: 18 gaps, 15 of them 0
    gaps = [0, 0, 0.3, 0, 0, 0.4, 0, 0, 0.1] + [0] * 9
    assert m["latency_p50_s"]["median"] == pytest.approx(0.0)
    assert m["latency_p99_s"]["median"] == pytest.approx(float(__import__("numpy").percentile(gaps, 99)))
    assert m["peak_mem_bytes"] == 300 and m["records"] == 4
    ar = summary["AR"]
    assert ar["speedup"]["median"] == 1.0 and ar["tokens_per_target_forward"]["median"] == 1.0
    assert ar["acceptance_rate"]["median"] is None  # nothing drafted: not applicable, not 0


def test_unknown_fields_stay_unknown():
    records = hand_made()
    for r in records:
        if r["label"] == "M" and r["prompt_id"] == "p2":
            r.update(drafted=None, draft_s=None, verify_s=None, ttft_s=None)
    m = metrics.summarize(records, "AR")["M"]
    assert m["decode_speedup"]["median"] is None  # no time to first token, no decode-only time
    assert m["acceptance_rate"]["median"] is None and m["discarded_per_token"]["median"] is None
    assert m["draft_share"]["median"] is None and m["other_share"]["median"] is None
    assert m["speedup"]["median"] is not None and m["tokens_per_target_forward"]["median"] is not None


def test_first_divergence_and_exactness_on_an_altered_output():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert metrics.first_divergence([1, 2, 3], [1, 2]) == 2
    records = hand_made()
    assert all(e["differ"] == 0 and e["compared"] == 2 for e in metrics.exactness(records, "AR").values())
    altered = next(r for r in records if r["label"] == "M" and r["prompt_id"] == "p2" and r["repeat"] == 1)
    altered["tokens"] = altered["tokens"][:7] + [99] + altered["tokens"][8:]
    result = metrics.exactness(records, "AR")["M"]
    assert result["differ"] == 1 and result["cases"] == [{"prompt_id": "p2", "repeat": 1, "position": 7}]


def test_oracle_rounds_follow_specdec_plus_plus():
    # X_1 comes from the prefill; disagreements at 4 and 7 end rounds, the last round ends at N = 10
    assert oracle_rounds(10, [1, 4, 7]) == [3, 3, 3]  # positions 2-4, 5-7, 8-10
    assert oracle_rounds(10, []) == [9]  # one round: 8 drafts accepted + 1
    assert oracle_rounds(10, [10]) == [9]  # a disagreement at N ends the last round itself
    assert oracle_rounds(5, [2, 3, 4, 5]) == [1, 1, 1, 1]  # the draft never helps: autoregressive
    assert oracle_rounds(1, [1]) == []
    costs = {"target": {1: 1.0, 2: 1.0, 4: 2.0}, "draft": {1: 0.1, 2: 0.1}}
    t_oracle, t_ar = oracle_times(10, [4, 7], prefill_s=5.0, draft_prefill_s=0.5, costs=costs)
    # three rounds of 3 tokens: 2 drafts (0.2) + a target forward of width 3 (1.5)
    assert t_oracle == pytest.approx(5.0 + 0.5 + 3 * (0.2 + 1.5))
    assert t_ar == pytest.approx(5.0 + 9 * 1.0)


def test_the_ceiling_drafts_at_the_best_length_on_the_curve():
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}  # verifying 8 tokens costs one step
    assert chain_factor(flat, 1.0, 0.0) == pytest.approx(1 / 8)  # always right and free: 8 tokens a step
    assert chain_factor({str(w): t for w, t in flat.items()}, 1.0, 0.0) == pytest.approx(
        1 / 8
    )  # a curve read back from JSON
    assert chain_factor(flat, 0.5, 0.0) == pytest.approx(1 / (2 - 0.5**7))  # the longest chain still pays
    assert chain_factor(flat, 0.0, 0.0) == 1.0  # never right: plain decoding
    linear = {1: 1.0, 2: 2.0, 4: 4.0}  # every row costs a step: no draft pays, however good
    assert chain_factor(linear, 1.0, 0.0) == 1.0
    # one row nearly free: one drafted token right half the time for 0.2 + 0.1 steps pays 1.5 / 1.3
    assert chain_factor({1: 1.0, 2: 1.2, 4: 4.0}, 0.5, 0.1) == pytest.approx(1.3 / 1.5)
    # the prompt's forward is not sped up: 2 s of prefill, 8 s of steps at a factor of 1/4
    assert ceiling_times(10, 2.0, 10.0, 0.25) == pytest.approx(4.0)
    assert ceiling_times(1, 2.0, 2.0, 0.25) == 2.0  # one token comes from the prefill alone


def test_ceiling_table_bounds_every_drafter_and_names_the_acceptance_needed():
    records = [
        rec("AR", "p1", 0, wall=10.0, ttft=2.0),
        rec("AR", "p2", 0, wall=10.0, ttft=8.0),
        rec("M", "p1", 0, wall=5.0),
    ]
    table = metrics.ceiling_table(records, "AR", {"target": {1: 1.0, 2: 1.0, 4: 1.0}})
    by_prompt = {row["prompt_id"]: row for row in table["prompts"]}
    assert by_prompt["p1"]["ceiling"] == pytest.approx(10 / (2 + 8 / 4)) and by_prompt["p2"]["prefill_share"] == 0.8
    assert table["ceiling"] == pytest.approx(math.sqrt(10 / 4 * 10 / (8 + 2 / 4)))
    assert table["grid"][0.0][1.0] == pytest.approx(table["ceiling"]) and table["grid"][0.3][1.0] < table["ceiling"]
    assert all(a <= b for row in table["grid"].values() for a, b in zip(list(row.values()), list(row.values())[1:]))
    needed = table["needed"][0.0]
    assert needed[1.2] is not None and table["grid"][0.0][1.0] < 2.0 and needed[2.0] is None  # beyond reach
    a = needed[1.2]  # the least acceptance (to 0.01) that reaches 1.2x

    def speed(acc):
        factor = chain_factor({1: 1.0, 2: 1.0, 4: 1.0}, acc, 0.0)
        return math.sqrt(math.prod(10 / ceiling_times(10, t, 10.0, factor) for t in (2.0, 8.0)))

    assert speed(a) >= 1.2 > speed(a - 0.01)
    assert metrics.ceiling_table(records, "AR", {}) is None  # no measured curve, no ceiling


def test_forward_time_interpolates_and_extrapolates():
    table = {"1": 1.0, "2": 2.0, "4": 2.0, "16": 5.0}  # keys as they come back from JSON
    assert forward_time(table, 1) == 1.0 and forward_time(table, 3) == 2.0
    assert forward_time(table, 10) == pytest.approx(3.5)
    assert forward_time(table, 28) == pytest.approx(8.0)  # the last segment's slope, extended


def test_interleaving_order():
    assert schedule(["p1", "p2"], ["A", "B", "C"], 2) == [
        ("p1", 0, "A"),
        ("p1", 0, "B"),
        ("p1", 0, "C"),
        ("p1", 1, "A"),
        ("p1", 1, "B"),
        ("p1", 1, "C"),
        ("p2", 0, "A"),
        ("p2", 0, "B"),
        ("p2", 0, "C"),
        ("p2", 1, "A"),
        ("p2", 1, "B"),
        ("p2", 1, "C"),
    ]


def test_method_specs():
    assert split_specs("a,b[k=1,x=2], c:p[y=3]") == ["a", "b[k=1,x=2]", "c:p[y=3]"]
    specs = parse_specs(
        "speculative[k=6,policy=heuristic],speculative:k2,hf-assisted[num_assistant_tokens=5,warm=false],hf-prompt-lookup"
    )
    assert [s.label for s in specs] == [
        "autoregressive",
        "speculative[k=6,policy=heuristic]",
        "speculative:k2",
        "hf-assisted[num_assistant_tokens=5,warm=false]",
        "hf-prompt-lookup",
    ]
    assert specs[1].config == SpeculativeConfig(policy="heuristic", k=6) and specs[2].config == SpeculativeConfig(
        policy="constant", k=2
    )
    assert specs[3].config == AssistedConfig(num_assistant_tokens=5) and not specs[3].warm and specs[3].drafts.required
    assert specs[4].config.prompt_lookup_num_tokens == 10 and not specs[4].drafts.loads and specs[4].is_peer
    assert parse_specs("hf-prompt-lookup,autoregressive")[0].label == "autoregressive"  # the baseline goes first
    assert not parse_specs("autoregressive")[1:]
    peers = parse_specs("hf-autoregressive,llamacpp,llamacpp-prompt-lookup[num_pred_tokens=4]")
    assert [s.engine for s in peers] == ["draftverify", "transformers", "llama.cpp", "llama.cpp"]
    assert peers[3].config.num_pred_tokens == 4 and not any(s.drafts.loads for s in peers)
    with pytest.raises(DraftVerifyError, match="num_pred_tokens=0 must be an integer >= 1"):
        parse_specs("llamacpp-prompt-lookup[num_pred_tokens=0]")
    llama = parse_specs("llamacpp,llamacpp-f32,llamacpp-prompt-lookup")[1:]
    assert [s.gguf for s in llama] == ["file", "f32", "file"]  # the user's own file, and the F32 re-export


def test_one_registry_for_methods_drafters_and_peers():
    """Peers go through the methods' own config path; every name resolves in one place."""
    assert {"autoregressive", "prompt-lookup", "hf-assisted", "llamacpp-f32"} <= set(names())
    assert entry("prompt-lookup") is METHODS["prompt-lookup"]  # a standalone drafter, as a method
    assert entry("hf-assisted") is PEERS["hf-assisted"]
    # a peer preset plus an override, and None overrides ignored, exactly as Method.make_config does
    config = entry("hf-assisted").make_config("heuristic", num_assistant_tokens=3, assistant_confidence_threshold=None)
    assert config == AssistedConfig(num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic")
    assert parse_specs("prompt-lookup:k4")[1].config == PromptLookupConfig(k=4, k1=4)
    assert HfPromptLookupConfig is not PromptLookupConfig and HfPromptLookupConfig.__name__ != "PromptLookupConfig"


@pytest.mark.parametrize(
    "text, message",
    [
        ("nope", "unknown method 'nope'"),
        ("speculative[k=4", "unclosed"),
        ("speculative]", "bad brackets"),
        ("speculative[k]", "write key=value"),
        ("speculative[bogus=1]", "unknown option 'bogus'"),
        ("speculative:nope", "unknown preset 'nope'"),
        ("speculative[k=0]", "k=0 must lie"),
        ("hf-assisted[foo=1]", "unknown option 'foo' for method hf-assisted"),
        ("hf-assisted:nope", "unknown preset 'nope' for hf-assisted: use one of heuristic"),
        ("hf-prompt-lookup[prompt_lookup_num_tokens=0]", "must be an integer >= 1"),
        ("speculative,speculative", "listed twice"),
        ("speculative[warm=maybe]", "must be true or false"),
    ],
)
def test_bad_specs_are_refused_in_one_line(text, message):
    with pytest.raises(DraftVerifyError, match=message) as err:
        parse_specs(text)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def data_dir():
    try:
        return resolve_data_dir(None)
    except DraftVerifyError:
        pytest.skip("the shared benchmark data folder is not on this machine")


def test_datasets_on_the_real_files(data_dir):
    rows = {name: load(data_dir) for name, load in DATASETS.items()}
    assert {name: len(r) for name, r in rows.items()} == {
        "spec_bench": 480,
        "mt_bench": 80,
        "humaneval": 164,
        "gsm8k": 300,
        "cnn_dailymail": 80,
    }
    spec_categories = {}
    for _, category, turns, _ in rows["spec_bench"]:
        spec_categories[category] = spec_categories.get(category, 0) + 1
    assert spec_categories == {
        c: 80 for c in ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")
    }
    assert len({r[1] for r in rows["mt_bench"]}) == 8
    prompts = load_prompts(["spec_bench"], data_dir)
    assert len(prompts) == 560  # the 80 multi-turn rows give turn 1 and turn 2
    second = next(p for p in prompts if p.turn == 2)
    assert second.id == "spec_bench/81#2" and second.turns[0] == prompts[0].turns[0] and second.category == "multi_turn"
    assert len(load_prompts(["spec_bench"], data_dir, turns="first")) == 480
    per_cat = load_prompts(["spec_bench", "humaneval"], data_dir, per_category=2, turns="first")
    assert len(per_cat) == 6 * 2 + 2
    humaneval = [p for p in per_cat if p.dataset == "humaneval"]
    assert (
        humaneval[0].id == "humaneval/HumanEval/0"
        and not humaneval[0].chat
        and humaneval[0].turns[0].startswith("from typing")
    )
    assert [p.id for p in load_prompts(["gsm8k", "cnn_dailymail"], data_dir, limit=1)] == [
        "gsm8k/gsm8k-test-0000",
        "cnn_dailymail/specbench-241",
    ]


def test_select_and_user_jsonl(tmp_path):
    rows = [(str(i), "ab"[i % 2], ("x",), True) for i in range(6)]
    assert [r[0] for r in select(rows, None, 2)] == ["0", "1", "2", "3"]
    assert [r[0] for r in select(rows, 3, 2)] == ["0", "1", "2"]
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"prompt": "Hi", "category": "greet"}) + "\n\n" + json.dumps({"id": "q2", "prompt": "Yo"}) + "\n"
    )
    prompts = load_prompts([], None, path)
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("mine/1", "greet", ("Hi",)),
        ("mine/q2", "mine", ("Yo",)),
    ]
    path.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(DraftVerifyError, match='line 1 has no non-empty "prompt"'):
        load_prompts([], None, path)
    path.write_text("{not json\n")
    with pytest.raises(DraftVerifyError, match="line 1 is not valid JSON"):
        load_prompts([], None, path)
    with pytest.raises(DraftVerifyError, match="unknown data set 'nope'"):
        load_prompts(["nope"], tmp_path)


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTVERIFY_DATA_DIR", raising=False)
    assert resolve_data_dir(tmp_path) == tmp_path
    with pytest.raises(DraftVerifyError, match="--data-dir .* is not a folder"):
        resolve_data_dir(tmp_path / "missing")
    monkeypatch.setenv("DRAFTVERIFY_DATA_DIR", str(tmp_path))
    assert resolve_data_dir(None) == tmp_path
    monkeypatch.delenv("DRAFTVERIFY_DATA_DIR")
    (tmp_path / "work" / "here").mkdir(parents=True)
    (tmp_path / "work" / "shared" / "data").mkdir(parents=True)
    assert resolve_data_dir(None, cwd=tmp_path / "work" / "here") == (tmp_path / "work" / "shared" / "data").resolve()


def test_record_log_drops_a_torn_line_and_refuses_another_config(tmp_path):
    path = tmp_path / "records.jsonl"
    log = RecordLog(path, {"a": 1})
    log.append({"type": "generation", "prompt_id": "p", "repeat": 0, "label": "A", "tokens": [1]})
    with open(path, "a") as f:
        f.write('{"type": "generation", "prompt_id": "p", "rep')  # killed mid-write
    again = RecordLog(path, {"a": 1})
    assert list(again.generations) == [("p", 0, "A")]
    assert path.read_text().endswith("}\n")
    with pytest.raises(DraftVerifyError, match=r"holds a run with another config \(a: 1 there, 2 now\)") as err:
        RecordLog(path, {"a": 2})
    assert "\n" not in str(err.value)
    assert RecordLog(path, {"a": 2}, overwrite=True).generations == {}
