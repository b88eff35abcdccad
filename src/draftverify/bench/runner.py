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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from draftverify.bench import llamacpp
from draftverify.bench.datasets import Prompt
from draftverify.bench.measure import environment, peak_memory
from draftverify.bench.oracle import teacher_forced_disagreements
from draftverify.bench.peers import PeerState
from draftverify.bench.records import RecordLog, schedule
from draftverify.bench.report import write_all
from draftverify.bench.results import assemble
from draftverify.bench.specs import BenchSpec
from draftverify.costs import WIDTHS, forward_times
from draftverify.engine import Engine
from draftverify.errors import DraftVerifyError, require
from draftverify.loading import stock_model
from draftverify.methods.base import Artifact
from draftverify.sampling import Sampling

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
    max_new_tokens: int = 256
    repeats: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompt_format: str = "auto"  # auto: each set's own (chat for instruct models, raw for HumanEval)
    warmup_tokens: int = 8
    dtype: str = "auto"  # the target's arithmetic as asked for (`Engine.load(dtype=...)`), named in the report

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
        return Sampling(self.temperature, self.top_k, self.top_p, seed=seed)


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
            drafts = spec.drafts
            require(
                not drafts.required
                or drafts.choose(has_head=engine.feature_head is not None) is Artifact.FEATURE_HEAD
                or engine.draft is not None,
                f"method {spec.label!r} needs a draft model: pass --draft (e.g. self:layers=8) "
                "or drop it from --methods",
            )
        self.gguf_kinds = sorted({s.gguf for s in specs if s.engine == "llama.cpp"})  # which GGUFs llama.cpp runs
        if self.gguf_kinds:
            llamacpp.require_llamacpp()
            for kind in self.gguf_kinds:
                llamacpp.gguf_for(engine.target.source, engine.target.name, kind)  # an F32 export: made once, cached
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
            "head": self.engine.feature_head.name if self.engine.feature_head is not None else None,
            "dtype": str(self.engine.target.model.dtype),
            "arithmetic": self.arithmetic(),
            "backend": self.engine.target_runner.backend,
            "device": str(self.device),
            "prompts": len(self.prompts),
            "prompts_sha1": ids,
            "methods": [s.label for s in self.specs],
            **dataclasses.asdict(self.settings),
        }

    def arithmetic(self) -> str:
        """The target's arithmetic: what the engine says it runs, else the dtype asked for, else its weights' dtype."""
        said = getattr(self.engine, "arithmetic", None)
        if isinstance(said, str):
            return said
        asked = self.settings.dtype
        return asked if asked != "auto" else str(self.engine.target.model.dtype).replace("torch.", "")

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
        sampling, eos = self.settings.sampling(seed), self.engine.eos_ids()
        with peak_memory(self.device) as memory:
            if spec.is_peer:
                fields = self.peer_state(spec).generate(ids, sampling, max_new_tokens, eos)
            else:
                fields = self.generate_ours(spec, ids, max_new_tokens, sampling)
        return {**fields, **memory}

    def same_start(self, spec: BenchSpec, prompt_id: str, starts: dict) -> None:
        """Every repeat of a prompt starts a warm method from the state its first repeat (in this process) started
        from: a phrase pool kept from the first repeat would hold that repeat's own reply and draft the later ones
        from it (Ouroboros, Lookahead with `reuse`), and `auto`'s figures would have learnt from it. A repeat
        measures the same generation again; the warm start from the earlier prompts stays."""
        if self.settings.repeats < 2 or spec.is_peer or not spec.warm:
            return
        method = self.engine.method(spec.name, spec.preset, **{k: v for k, v in spec.options if k != "warm"})
        start = starts.get(spec.label)
        if start is not None and start[0] == prompt_id:
            method.restore_warm_state(start[1])
        else:
            starts[spec.label] = (prompt_id, method.warm_state())

    def peer_state(self, spec: BenchSpec):
        """The peer's instance (kept across prompts unless `warm=false`): llama.cpp, or transformers' `generate`."""
        engine, state = self.engine, self.peer_states.get(spec.label)
        if state is None or not spec.warm:
            if spec.engine == "llama.cpp":
                state = llamacpp.peer(spec, engine.target.source, engine.target.name, self.n_ctx())
            else:
                draft = stock_model(engine.draft.model) if engine.draft is not None else None
                state = PeerState(spec, stock_model(engine.target.model), draft)
            self.peer_states[spec.label] = state
        return state

    def generate_ours(self, spec: BenchSpec, ids: list[int], max_new_tokens: int, sampling: Sampling) -> dict:
        """One generation of one of draftverify's methods; a fresh method instance when `warm=false`."""
        engine = self.engine
        runner = (
            engine
            if spec.warm
            else Engine(engine.target, engine.draft_source, engine.backend, feature_head=engine.feature_head)
        )
        result = runner.generate(
            ids,
            method=spec.name,
            preset=spec.preset,
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed,
            **{k: v for k, v in spec.options if k != "warm"},
        )
        return {"tokens": result.tokens, **{k: getattr(result.stats, k) for k in STAT_FIELDS}}

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
        self.engine.shared.full_curves = True  # the warm-up measures full curves (costs.curves), as a server's start
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
        starts: dict[str, tuple[str, object]] = {}  # label -> (prompt id, the warm state its repeats start from)
        with bar:
            for prompt_id, repeat, label in todo:
                bar.set_postfix_str(f"{prompt_id} {label}", refresh=False)
                prompt = prompts[prompt_id]
                self.same_start(specs[label], prompt_id, starts)
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
        for kind in self.gguf_kinds:  # the same buckets, all logits, on llama.cpp: per GGUF its peers run
            path = llamacpp.gguf_for(self.engine.target.source, self.engine.target.name, kind)
            model = llamacpp.LlamaCpp(path, self.n_ctx(), torch.get_num_threads(), logits_all=True)
            costs[llamacpp.COST_KEYS[kind]] = model.forward_times(context, WIDTHS)
            del model
        return costs

    def add_oracles(self, log: RecordLog) -> None:
        """Teacher-force the draft over each prompt's autoregressive output (first repeat)."""
        if self.engine.draft is None or not any(s.drafts.required for s in self.specs):
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
        order = schedule(list(self.ids), [s.label for s in self.specs], self.settings.repeats)
        records = [log.generations[job] for job in order if job in log.generations]
        oracles = [log.oracles[p] for p in self.ids if p in log.oracles]
        env = environment(self.device)
        if self.gguf_kinds:  # the llama.cpp build the peers ran: its version and the CPU features it was built with
            env["llamacpp"] = llamacpp.build()
        head = {"command": command, "config": self.config(), "environment": env}
        return assemble(self, records, oracles, log.costs or {}, head)
