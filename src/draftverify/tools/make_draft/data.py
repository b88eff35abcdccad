"""Distillation data: token sequences with the target's top-k next-token log-probabilities.

Sources, stored alike as `TrainingRecord`s in shards on disk (written atomically, so an interrupted
build keeps every finished shard and `--resume` never redoes them):
- "chat": the target's own continuations (greedy, or sampled for one batch in four) of chat
  prompts written from templates (`prompts.py`), made with batched `model.generate`, whose raw
  logits give the targets at every generated position for free;
- "replies" (with `--prompts`): the target's replies to the prompts of a file, decoded together on the
  engine (its own arithmetic and kernels, several times faster than `model.generate` on a CPU), each
  scored by one teacher-forced forward of the target; greedy on the first pass over the file,
  sampled on later ones;
- "text": chat conversations whose assistant turn is Python stdlib text, scored by one
  teacher-forced forward of the target.
"""

from __future__ import annotations

import json
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.loading import Loaded
from draftverify.tools.make_draft.prompts import Stdlib, make_documents, make_prompts
from draftverify.tools.replies import SAMPLED, answer
from draftverify.util import atomic_path, atomic_write

MAX_PROMPT_TOKENS = 256  # longer template prompts are skipped: padding them costs more than they teach
MAX_FILE_PROMPT_TOKENS = 384  # a --prompts file's prompts up to this long are answered (long inputs are real use)
SCORED_TOKENS = 2048  # padded tokens per teacher-forced scoring forward (its logits: this many rows of the vocabulary)


@dataclass
class TrainingRecord:
    """One sequence; position `start + j` (predicting token `start + j + 1`) has target row j."""

    ids: torch.Tensor  # [T] int32 token ids
    start: int  # first position with a target
    logp: torch.Tensor  # [n, k] fp16: the target's log-probabilities of its top-k tokens (descending)
    idx: torch.Tensor  # [n, k] int32: those tokens


@dataclass(frozen=True)
class DataPlan:
    """What makes cached data fit a build; a cache made with another plan is refused.

    How many prompts go in one generate, how long the replies are and which kind of shard comes
    next are not part of it: shards made with other such settings are just as valid.
    """

    target: dict  # Loaded.identity of the target
    seed: int
    topk: int
    prompts: str = ""  # "<file name>:<count>" when the replies answer --prompts ("": the template prompts)


def load_checked(path: Path, what: str) -> dict:
    """torch.load a file this module wrote, refusing a corrupt one with a one-line error."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated or foreign files raise many different errors
        raise DraftVerifyError(f"{what} {path} is corrupt ({type(exc).__name__}): delete it and run again") from exc


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (log-probs [..., k] fp16, token ids [..., k] int32) of the k most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, idx = logp.topk(k, dim=-1)
    return values.half(), idx.int()


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def generated_records(
    target: Loaded, prompts: list[list[int]], max_new_tokens: int, k: int, sample: bool
) -> list[TrainingRecord]:
    """The target's continuations of `prompts` (one batched generate), with top-k targets per new token."""
    got = answer(target, prompts, max_new_tokens, SAMPLED if sample else None, output_logits=True)
    logits = torch.stack(got.out.logits, dim=1)  # [B, G, V] raw logits of every step
    records = []
    for b, (p, reply) in enumerate(zip(prompts, got.replies)):
        logp, idx = topk_logprobs(logits[b, : len(reply)], k)
        records.append(TrainingRecord(torch.tensor(p + reply, dtype=torch.int32), len(p) - 1, logp.cpu(), idx.cpu()))
    return records


@torch.inference_mode()
def forced_records(target: Loaded, sequences: list[list[int]], k: int) -> list[TrainingRecord]:
    """Targets at every position of fixed `sequences` (one right-padded forward of the target)."""
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(input_ids)
    for b, s in enumerate(sequences):
        input_ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    device = target.device
    logits = target.model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits  # [B, T, V]
    records = []
    for b, s in enumerate(sequences):
        logp, idx = topk_logprobs(logits[b, : len(s) - 1], k)
        records.append(TrainingRecord(torch.tensor(s, dtype=torch.int32), 0, logp.cpu(), idx.cpu()))
    return records


@dataclass
class Prompts:
    """A draft build's --prompts: the file's prompts as token ids, shuffled by the seed, the first `heldout` of them
    held out (their greedy replies measure the draft), and the engine that answers them."""

    heldout: list[list[int]]
    train: list[list[int]]
    engine: object  # draftverify.engine.Engine on the target
    label: str  # "<file name>:<prompts read>", which the data plan keeps

    @classmethod
    def read(cls, path: Path, engine, heldout: int, seed: int, longest: int = MAX_FILE_PROMPT_TOKENS) -> "Prompts":
        """The prompts of `path` (`prompt_files.read_prompts`) no longer than `longest` tokens."""
        from draftverify.prompt_files import read_prompts

        texts = read_prompts(path, at_least=heldout + 1)
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
        ids = [engine.encode(texts[i][0], chat=texts[i][1]) for i in order]
        ids = [p for p in ids if len(p) <= longest]
        require(len(ids) > heldout, f"{path}: fewer than {heldout + 1} prompts of at most {longest} tokens")
        return cls(ids[:heldout], ids[heldout:], engine, f"{Path(path).name}:{len(texts)}")


def answered_records(
    prompts: Prompts, target: Loaded, chunk: list[list[int]], max_new_tokens: int, k: int, seed, bf16: bool
) -> list[TrainingRecord]:
    """The engine's replies to `chunk` (decoded together; greedy, or sampled at `SAMPLED`'s settings from `seed`),
    with the targets at every reply position from a teacher-forced forward of `target` (its matmuls in bf16 when
    `bf16`: the targets of training data, not of decoding)."""
    sampled = {} if seed is None else {**SAMPLED, "seed": seed}
    results = prompts.engine.generate_batch(chunk, method="autoregressive", max_new_tokens=max_new_tokens, **sampled)
    records = []
    sequences = sorted(((p, p + r.tokens) for p, r in zip(chunk, results)), key=lambda pair: len(pair[1]))
    group: list = []
    for n, pair in enumerate(sequences):  # forwards of at most SCORED_TOKENS padded tokens: the logits are [B, T, V]
        group.append(pair)
        if n + 1 == len(sequences) or len(sequences[n + 1][1]) * (len(group) + 1) > SCORED_TOKENS:
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                scored = forced_records(target, [s for _, s in group], k)
            for (p, _), r in zip(group, scored):
                records.append(TrainingRecord(r.ids, len(p) - 1, r.logp[len(p) - 1 :], r.idx[len(p) - 1 :]))
            group = []
    return records


def template_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Template prompts as chat token ids, those of at most `MAX_PROMPT_TOKENS`, shortest first."""
    ids = [chat_ids(tokenizer, [{"role": "user", "content": t}], True) for t in texts]
    return sorted((i for i in ids if len(i) <= MAX_PROMPT_TOKENS), key=len)


def _replies_shard(
    prompts: Prompts, target: Loaded, n: int, gen_batch: int, max_new_tokens: int, plan: DataPlan, i: int, bf16: bool
) -> tuple[list[TrainingRecord], str]:
    """Shard i, the `n`-th of replies to --prompts: the next `gen_batch` training prompts, answered greedily on the
    first pass over them and sampled (seeded by the shard, so a resumed build makes the same) on later passes,
    scored with bf16 matmuls when `bf16`; and the shard's kind."""
    chunks = -(-len(prompts.train) // gen_batch)
    chunk = prompts.train[(n % chunks) * gen_batch :][:gen_batch]
    seed = plan.seed * 7919 + i if n >= chunks else None
    records = answered_records(prompts, target, chunk, max_new_tokens, plan.topk, seed, bf16)
    return records, "replies-greedy" if seed is None else "replies-sampled"


def record_dicts(records: list[TrainingRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def keep_plan(folder: Path, plan, what: str) -> None:
    """Record `plan` (a dataclass) in folder/plan.json, or refuse a folder that was made with another plan."""
    path = folder / "plan.json"
    if not path.is_file():
        atomic_write(path, json.dumps(asdict(plan), indent=1))
        return
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DraftVerifyError(f"{path} is corrupt: delete {folder} and run again") from exc
    defaults = {f.name: f.default for f in fields(plan) if f.default is not MISSING}  # settings added since it was made
    require(
        {**json.loads(json.dumps(defaults)), **stored} == json.loads(json.dumps(asdict(plan))),
        f"{what} in {folder} was made for another target or settings: use another --work folder or delete it",
    )


class ShardFolder:
    """Shards of one build under `work/<subfolder>`: `plan.json`, `heldout.pt`, `shard-NNNNN.pt`, each
    shard a dict whose `key` entry lists `item`s as dicts. A folder made under another plan is refused."""

    subfolder: str
    key: str
    item: type
    what: str  # how errors name this data

    def __init__(self, work: Path, plan, subfolder: str | None = None):
        self.folder = Path(work) / (subfolder or self.subfolder)
        self.plan = plan
        keep_plan(self.folder, plan, self.what)

    def shards(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.pt"))

    def read(self, path: Path) -> dict:
        """A shard as written, refusing a corrupt or foreign file with a one-line error."""
        data = load_checked(path, "data shard")
        require(
            isinstance(data, dict) and self.key in data,
            f"{path} is not a shard of {self.what}: delete it and run again",
        )
        return data

    def load(self, path: Path) -> list:
        return [self.item(**r) for r in self.read(path)[self.key]]

    def heldout(self) -> list:
        return self.load(self.folder / "heldout.pt")


class DataCache(ShardFolder):
    """The distillation data of a draft-model build (`work/data`)."""

    subfolder, key, item, what = "data", "records", TrainingRecord, "the data cache"

    def records(self) -> tuple[list[TrainingRecord], dict]:
        """Every cached training record, and per kind of shard: shards, sequences and target positions."""
        records, summary = [], {}
        for path in self.shards():
            data = self.read(path)
            part = [TrainingRecord(**r) for r in data["records"]]
            row = summary.setdefault(data.get("kind", "unknown"), {"shards": 0, "sequences": 0, "positions": 0})
            row["shards"] += 1
            row["sequences"] += len(part)
            row["positions"] += sum(r.logp.shape[0] for r in part)
            records += part
        return records, summary

    def fill(
        self,
        target: Loaded,
        deadline: float,
        heldout_prompts: int,
        gen_batch: int,
        max_new_tokens: int,
        text_every: int,
        max_shards: int | None = None,
        log=print,
        prompts: Prompts | None = None,
        bf16: bool = False,
    ) -> None:
        """Make the held-out set, then shards until `deadline` (time.monotonic) or `max_shards` exist (at least one).

        Shard i is teacher-forced stdlib text when `i % text_every == text_every - 1` (never when `text_every`
        is 0), else the target's replies to `gen_batch` prompts: the next of `prompts` (`_replies_shard`) or
        template prompts."""
        plan, tok = self.plan, target.tokenizer
        lib = Stdlib.load()
        require(
            lib.functions and lib.topics, "the Python standard library sources are not installed: cannot build prompts"
        )

        if not (self.folder / "heldout.pt").is_file():
            if prompts is not None:  # scored in the target's own arithmetic: the card's agreement is measured on it
                records = answered_records(prompts, target, prompts.heldout, max_new_tokens, plan.topk, None, False)
            else:
                ids = template_ids(tok, make_prompts(heldout_prompts, plan.seed + 1_000_003, lib))
                records = generated_records(target, ids, max_new_tokens, plan.topk, sample=False)
            log(f"held-out set: {len(records)} greedy replies, {self.save('heldout.pt', records)} target positions")
        i = len(self.shards())
        while (i == 0 or time.monotonic() < deadline) and (max_shards is None or i < max_shards):  # at least one shard
            t0 = time.monotonic()
            if text_every and i % text_every == text_every - 1:
                docs = make_documents(max(1, gen_batch // 2), plan.seed * 7919 + i, lib)
                longest = min(
                    2 * MAX_PROMPT_TOKENS, getattr(target.model.config, "max_position_embeddings", None) or 10**9
                )
                seqs = [chat_ids(tok, d, False)[:longest] for d in docs]
                records, kind = forced_records(target, seqs, plan.topk), "text"
            elif prompts is not None:
                replies = i - (i + 1) // text_every if text_every else i  # replies shards before this one
                records, kind = _replies_shard(prompts, target, replies, gen_batch, max_new_tokens, plan, i, bf16)
            else:
                torch.manual_seed(plan.seed * 7919 + i)  # one seed per shard: a resumed build makes the same data
                sample = i % 4 == 2
                ids = template_ids(tok, make_prompts(gen_batch, plan.seed * 7919 + i, lib))
                # every prompt may be too long for a tokenizer with short tokens: then the shard is empty
                records = generated_records(target, ids, max_new_tokens, plan.topk, sample) if ids else []
                kind = "chat-sampled" if sample else "chat-greedy"
            positions = self.save(f"shard-{i:05d}.pt", records, kind)
            log(f"data shard {i} ({kind}): {positions} target positions in {time.monotonic() - t0:.0f}s")
            i += 1

    def save(self, name: str, records: list[TrainingRecord], kind: str | None = None) -> int:
        """Write `records` (of `kind`) as the file `name` of the cache, atomically; returns their target positions."""
        with atomic_path(self.folder / name) as tmp:
            torch.save({"records": record_dicts(records), **({"kind": kind} if kind else {})}, tmp)
        return sum(r.logp.shape[0] for r in records)
