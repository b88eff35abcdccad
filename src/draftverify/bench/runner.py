"""The benchmark protocol: one process, one Engine, every method on the same prompts.

1. Resume: `records.jsonl` in the output folder starts with the run's config; a rerun with
   the same config skips the generations already recorded, another config is refused.
2. Multi-turn prompts get the answers to their earlier turns from greedy autoregressive
   decoding (recorded once, identical for every method).
3. Warm-up: one short generation per method on a neutral prompt (not recorded).
4. Cost model: one target / draft forward of 1, 2, 4, 8, 16 new tokens, timed (oracle.py).
5. Measure, interleaved prompt by prompt: for each prompt, for each repeat, every method in
   turn (A B C A B C ...), so that drift of the machine hits all methods alike. Every
   generation is appended to `records.jsonl` as soon as it ends.
6. Oracle: the draft teacher-forced over each prompt's autoregressive output.
7. Summaries (metrics.py), then results.json, results.csv, report.md and the plots.

The engine's method instances live across prompts (warm start), unless a spec says `warm=false`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from draftverify.bench import llamacpp, metrics
from draftverify.bench.datasets import Prompt, category_key
from draftverify.bench.measure import environment, peak_memory
from draftverify.bench.oracle import teacher_forced_disagreements
from draftverify.bench.peers import PeerState, run_peer
from draftverify.bench.report import jsonable, write_all
from draftverify.bench.specs import BenchSpec
from draftverify.costs import WIDTHS, forward_times
from draftverify.engine import Engine
from draftverify.errors import DraftVerifyError, require
from draftverify.sampling import Sampling
from draftverify.util import atomic_write

FORMATS = ("auto", "chat", "raw")
WARMUP_PROMPT = "Hello! Say one sentence about the weather."
COST_CONTEXT = 128  # tokens of context before the timed forwards of the cost model
STAT_FIELDS = (
    "new_tokens",
    "wall_s",
    "ttft_s",
    "token_times",
    "target_forwards",
    "draft_forwards",
    "drafted",
    "accepted",
    "steps",
    "draft_s",
    "verify_s",
    "finish_reason",
    "extra",
)


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 128
    repeats: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompt_format: str = "auto"  # auto: each set's own (chat for instruct models, raw for HumanEval)
    warmup_tokens: int = 8

    def __post_init__(self):
        require(self.max_new_tokens >= 1, f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        require(self.repeats >= 1, f"--repeats {self.repeats} must be at least 1")
        require(
            self.prompt_format in FORMATS, f"--prompt-format {self.prompt_format!r} is unknown: use auto, chat or raw"
        )
        Sampling(self.temperature, self.top_k, self.top_p)  # validates the sampling values

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampling(self, seed: int | None) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, seed)


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


def messages_for(prompt: Prompt, answers: list[str]) -> list[dict]:
    """The chat messages of a prompt: its user turns interleaved with the earlier answers."""
    messages = []
    for i, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        if i < len(prompt.turns) - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


class Bench:
    """One benchmark run over `prompts` with `specs` (the baseline first) on `engine`."""

    def __init__(
        self, engine: Engine, prompts: list[Prompt], specs: list[BenchSpec], settings: Settings, out_dir: Path
    ):
        require(prompts, "no prompts to benchmark: check --datasets, --prompts, --limit and --per-category")
        require(specs and specs[0].is_baseline, "the autoregressive baseline must come first")
        for spec in specs:
            require(
                engine.draft is not None or not spec.needs_draft or (engine.head is not None and spec.takes_head),
                f"method {spec.label!r} needs a draft model: pass --draft (e.g. self:layers=8) or drop it from --methods",
            )
        if any(s.engine == "llama.cpp" for s in specs):
            llamacpp.require_llamacpp()
            llamacpp.gguf_for(engine.target.source, engine.target.name)  # converted once, cached
        self.engine, self.prompts, self.specs, self.settings = engine, prompts, specs, settings
        self.out_dir = Path(out_dir)
        self.device = engine.target.device
        self.peer_states: dict[str, PeerState] = {}
        self.ids: dict[str, list[int]] = {}
        self.skipped: dict[str, str] = {}
        self.chat_template = bool(getattr(engine.target.tokenizer, "chat_template", None))
        require(
            settings.prompt_format != "chat" or self.chat_template,
            "--prompt-format chat, but the target's tokenizer has no chat template: use --prompt-format raw or auto",
        )

    # -- configuration and resume ---------------------------------------------------------

    def config(self) -> dict:
        """Everything that must match for a run to be resumed."""
        ids = hashlib.sha1(json.dumps([[p.id, p.turns, p.chat] for p in self.prompts]).encode()).hexdigest()[:16]
        draft = self.engine.draft
        return {
            "target": self.engine.target.name,
            "target_identity": self.engine.target.identity,
            "draft": draft.name if draft is not None else None,
            "draft_identity": draft.identity if draft is not None else None,
            "head": self.engine.head.name if self.engine.head is not None else None,
            "dtype": str(self.engine.target.model.dtype),
            "backend": self.engine.target_runner.backend,
            "device": str(self.device),
            "prompts": len(self.prompts),
            "prompts_sha1": ids,
            "methods": [s.label for s in self.specs],
            **dataclasses.asdict(self.settings),
        }

    # -- prompts ----------------------------------------------------------------------------

    def use_chat(self, prompt: Prompt) -> bool:
        wanted = prompt.chat if self.settings.prompt_format == "auto" else self.settings.prompt_format == "chat"
        return wanted and self.chat_template

    def answers(self, prompt: Prompt, log: RecordLog) -> list[str]:
        """The greedy autoregressive answers to the prompt's earlier turns (made once, logged)."""
        answers = []
        base = prompt.id.rsplit("#", 1)[0]
        for k in range(1, prompt.turn):
            key = f"{base}#{k}"
            if key not in log.contexts:
                earlier = dataclasses.replace(prompt, id=key, turns=prompt.turns[:k])
                ids = self.engine.encode(messages_for(earlier, answers))
                result = self.engine.generate(ids, method="autoregressive", max_new_tokens=self.settings.max_new_tokens)
                log.append({"type": "context", "prompt_id": key, "answer": result.text})
            answers.append(log.contexts[key])
        return answers

    def encode_all(self, log: RecordLog) -> None:
        context = self.engine.target_runner.max_length or 1 << 30
        for prompt in self.prompts:
            if prompt.turn > 1 and not self.use_chat(prompt):
                self.skipped[prompt.id] = "a later turn needs the chat template (raw format)"
                continue
            if self.use_chat(prompt):
                ids = self.engine.encode(messages_for(prompt, self.answers(prompt, log)))
            else:
                ids = self.engine.encode(prompt.turns[-1])
            if len(ids) + self.settings.max_new_tokens > context:
                self.skipped[prompt.id] = f"{len(ids)} prompt tokens + max_new_tokens exceed the context ({context})"
                continue
            self.ids[prompt.id] = ids
        if not self.ids:
            raise DraftVerifyError(
                f"every prompt was skipped ({next(iter(self.skipped.values()))}): pick other prompts or fewer tokens"
            )

    # -- one generation ---------------------------------------------------------------------

    def generate(self, spec: BenchSpec, ids: list[int], max_new_tokens: int, seed: int | None) -> dict:
        """Run one generation of `spec`; returns the measured fields with `tokens` and memory."""
        engine, sampling = self.engine, self.settings.sampling(seed)
        with peak_memory(self.device) as memory:
            if spec.engine == "llama.cpp":
                state = self.peer_states.get(spec.label)
                if state is None or not spec.warm:
                    state = self.peer_states[spec.label] = llamacpp.peer(
                        spec, engine.target.source, engine.target.name, self.n_ctx()
                    )
                fields = state.generate(ids, sampling, max_new_tokens, engine.eos_ids())
            elif spec.is_peer:
                draft = engine.draft.model if engine.draft is not None else None
                state = self.peer_states.get(spec.label)
                if state is None or not spec.warm:
                    state = self.peer_states[spec.label] = PeerState(spec, draft)
                fields = run_peer(
                    spec, state, engine.target.model, draft, ids, sampling, max_new_tokens, engine.eos_ids()
                )
            else:
                runner = (
                    engine if spec.warm else Engine(engine.target, engine.draft, engine.backend, head=engine.head)
                )  # fresh method instance
                result = runner.generate(
                    ids,
                    method=spec.name,
                    preset=spec.preset,
                    max_new_tokens=max_new_tokens,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    seed=seed,
                    **{k: v for k, v in spec.options if k != "warm"},
                )
                fields = {"tokens": result.tokens, **{k: getattr(result.stats, k) for k in STAT_FIELDS}}
        return {**fields, **memory}

    def n_ctx(self) -> int:
        """A context long enough for every prompt of the run plus its new tokens (llama.cpp peers)."""
        longest = max([len(ids) for ids in self.ids.values()] + [COST_CONTEXT])
        return longest + max(self.settings.max_new_tokens, max(WIDTHS)) + 16

    def seed(self, prompt_index: int, repeat: int) -> int | None:
        """The sampling seed of one prompt and repeat (the same for every method)."""
        return None if self.settings.greedy else self.settings.seed + prompt_index + repeat * len(self.prompts)

    # -- the run ----------------------------------------------------------------------------

    def run(
        self,
        command: str = "",
        overwrite: bool = False,
        progress: bool = True,
        on_record: Callable[[dict], None] | None = None,
    ) -> dict:
        from tqdm import tqdm

        log = RecordLog(self.out_dir / "records.jsonl", self.config(), overwrite=overwrite)
        self.encode_all(log)
        warmup = self.engine.encode(WARMUP_PROMPT, chat=self.chat_template)
        for spec in self.specs:
            self.generate(spec, warmup, self.settings.warmup_tokens, self.seed(0, 0))
        if log.costs is None:
            log.append({"type": "cost_model", "costs": self.measure_costs(next(iter(self.ids.values())))})
        index = {p.id: i for i, p in enumerate(self.prompts)}
        order = schedule(list(self.ids), [s.label for s in self.specs], self.settings.repeats)
        specs = {s.label: s for s in self.specs}
        prompts = {p.id: p for p in self.prompts}
        todo = [job for job in order if job not in log.generations]
        bar = tqdm(
            total=len(order),
            initial=len(order) - len(todo),
            desc="bench",
            unit="gen",
            disable=not progress,
            dynamic_ncols=True,
        )
        with bar:
            for prompt_id, repeat, label in todo:
                bar.set_postfix_str(f"{prompt_id} {label}", refresh=False)
                prompt = prompts[prompt_id]
                fields = self.generate(
                    specs[label], self.ids[prompt_id], self.settings.max_new_tokens, self.seed(index[prompt_id], repeat)
                )
                record = {
                    "type": "generation",
                    "prompt_id": prompt_id,
                    "dataset": prompt.dataset,
                    "category": prompt.category,
                    "turn": prompt.turn,
                    "repeat": repeat,
                    "label": label,
                    "method": specs[label].name,
                    "prompt_tokens": len(self.ids[prompt_id]),
                    **fields,
                }
                log.append(record)
                bar.update(1)
                if on_record is not None:
                    on_record(record)
        self.add_oracles(log)
        results = self.results(log, command)
        write_all(results, self.out_dir)
        return results

    def measure_costs(self, ids: list[int]) -> dict:
        """Forward times per number of new tokens, for the target (all logits) and the draft (last)."""
        context = (ids * (COST_CONTEXT // len(ids) + 1))[:COST_CONTEXT]
        costs = {
            "context_tokens": COST_CONTEXT,
            "backend": self.engine.describe_backend(),
            "target": forward_times(self.engine.target_runner, context),
        }
        if self.engine.draft is not None:
            costs["draft"] = forward_times(self.engine.draft_runner, context, all_logits=False)
        if any(s.engine == "llama.cpp" for s in self.specs):  # the same buckets, all logits, on llama.cpp
            model = llamacpp.LlamaCpp(
                llamacpp.gguf_for(self.engine.target.source, self.engine.target.name),
                self.n_ctx(),
                torch.get_num_threads(),
                logits_all=True,
            )
            costs["llamacpp"] = model.forward_times(context, WIDTHS)
            del model
        return costs

    def add_oracles(self, log: RecordLog) -> None:
        """Teacher-force the draft over each prompt's autoregressive output (first repeat)."""
        if self.engine.draft is None or not any(s.needs_draft for s in self.specs):
            return
        baseline = self.specs[0].label
        for prompt_id, ids in self.ids.items():
            record = log.generations.get((prompt_id, 0, baseline))
            if record is None or prompt_id in log.oracles:
                continue
            disagreements, prefill_s = teacher_forced_disagreements(self.engine.draft.model, ids, record["tokens"])
            log.append(
                {
                    "type": "oracle",
                    "prompt_id": prompt_id,
                    "n": len(record["tokens"]),
                    "disagreements": disagreements,
                    "draft_prefill_s": prefill_s,
                }
            )

    def results(self, log: RecordLog, command: str) -> dict:
        """Everything in results.json: config, environment, raw records and their summaries."""
        baseline = self.specs[0].label
        records = [
            log.generations[job]
            for job in schedule(list(self.ids), [s.label for s in self.specs], self.settings.repeats)
            if job in log.generations
        ]
        oracles = [log.oracles[p] for p in self.ids if p in log.oracles]
        costs = log.costs or {}
        groups = {}
        for r in records:
            groups.setdefault(category_key(r["dataset"], r["category"]), []).append(r)

        def oracle_for(recs):
            ids = {r["prompt_id"] for r in recs}
            return (
                metrics.oracle_table([o for o in oracles if o["prompt_id"] in ids], recs, baseline, costs)
                if "draft" in costs and oracles
                else None
            )

        return {
            "command": command,
            "config": self.config(),
            "environment": environment(self.device),
            "baseline": baseline,
            "greedy": self.settings.greedy,
            "methods": [
                {
                    "label": s.label,
                    "name": s.name,
                    "preset": s.preset,
                    "options": dict(s.options),
                    "peer": s.is_peer,
                    "engine": s.engine,
                    "needs_draft": s.needs_draft,
                    "warm": s.warm,
                    "config": dataclasses.asdict(s.config),
                }
                for s in self.specs
            ],
            "prompts": [
                {
                    "id": p.id,
                    "dataset": p.dataset,
                    "category": p.category,
                    "turn": p.turn,
                    "prompt_tokens": len(self.ids[p.id]),
                }
                for p in self.prompts
                if p.id in self.ids
            ],
            "skipped": [{"id": k, "reason": v} for k, v in self.skipped.items()],
            "cost_model": costs,
            "summary": {
                "all": metrics.summarize(records, baseline),
                "categories": {k: metrics.summarize(v, baseline) for k, v in groups.items()},
            },
            "exactness": metrics.exactness(records, baseline) if self.settings.greedy else None,
            "oracle": {"all": oracle_for(records), "categories": {k: oracle_for(v) for k, v in groups.items()}},
            "ceiling": {
                "all": metrics.ceiling_table(records, baseline, costs),
                "categories": {k: metrics.ceiling_table(v, baseline, costs) for k, v in groups.items()},
            },
            "oracles": oracles,
            "records": records,
        }
