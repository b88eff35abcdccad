"""Training data for a feature-level draft head: the target's own replies and its hidden states.

For instruction prompts (one JSON object per line with a "prompt" field, e.g.
`../shared/data/train_prompts/prompts.jsonl`), the target writes its greedy reply and, when the
plan asks (`sampled`), more replies sampled at T = 0.8, top-p 0.95 (other trajectories through
the target's own distribution: more data from the same prompts). Its last hidden state (after
the final norm: what its LM head reads) at every position comes out of the same decoding, no
second forward. Where the target runs on the static path (`static.py`), the replies are decoded
together by the engine's batch (`batch.Batch`: one stacked forward per step; `Recorder` keeps
the states): the static path's forward with no `generate` overhead per step,
and the same greedy tokens as `draftverify generate`; elsewhere by a batched `model.generate`.
A `Sequence` stores the token ids and those features in fp16; feature t predicts token t + 1
through the LM head.

Shards (`shard-NNNNN.pt`) are written atomically, one per batch of prompts in a fixed seeded
order, so an interrupted build keeps every finished shard and a resumed one continues with the
next prompts. A fixed slice of the prompts is held out (`heldout.pt`) to measure acceptance.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftverify.drafters.base import Drafter
from draftverify.errors import require
from draftverify.loading import Loaded
from draftverify.models import Runner
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping
from draftverify.step import Proposal, Step
from draftverify.tools.make_draft.data import ShardFolder, chat_ids
from draftverify.tools.replies import SAMPLED, answer
from draftverify.util import atomic_path, eos_ids


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] int32: prompt + reply
    start: int  # tokens of the prompt; the reply is ids[start:]
    features: torch.Tensor  # [T - 1, H] fp16: the target's final hidden state after each token but the last


@dataclass(frozen=True)
class FeaturePlan:
    """What makes cached data fit a build; a cache made with another plan is refused."""

    target: dict  # Loaded.identity of the target
    prompts: str  # name and line count of the prompt file
    seed: int
    heldout: int  # held-out prompts
    max_prompt_tokens: int
    max_new_tokens: int
    sampled: int = 0  # replies per prompt sampled besides the greedy one


class Recorder(Drafter):
    """Drafts nothing (each round is one plain decoding step) and keeps the target's final hidden state after
    every token: the prompt's at `start`, then the state that produced each emitted token."""

    needs_hidden = True

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        self.rows = [hidden]

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        return Proposal(hidden=True)

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        self.rows.append(step.hidden)


def generate(
    target: Loaded,
    prompts: list[list[int]],
    max_new_tokens: int,
    seeds: list[int | None] | None = None,
    runners: list[Runner] | None = None,
) -> list[Sequence]:
    """The target's replies to `prompts`, each cut after its first EOS, with the final hidden states the decoding
    computed on the way: greedy, or sampled (`SAMPLED`) with `seeds[i]` for prompt i where that is not None.

    `runners`: static runners of the target to decode on, one per prompt at least (their caches are reused);
    None decodes with a batched `model.generate` (every prompt greedy, or every prompt sampled)."""
    seeds = seeds or [None] * len(prompts)
    if runners is None:
        return _generated(target, prompts, max_new_tokens, seeds)
    from draftverify.batch import run_batch
    from draftverify.round import rounds

    eos = tuple(eos_ids(target))
    members, recorders = [], []
    for p, seed, runner in zip(prompts, seeds, runners):
        sampling = Sampling() if seed is None else Sampling(seed=seed, **SAMPLED)
        session = Session(list(p), sampling, Stopping(max_new_tokens, eos))
        recorders.append(Recorder())
        members.append((session, runner, rounds(session, runner, recorders[-1])))
    run_batch(members)
    return [
        Sequence(torch.tensor(s.prompt + s.output, dtype=torch.int32), len(s.prompt), torch.cat(r.rows).half().cpu())
        for (s, _, _), r in zip(members, recorders)
    ]


def _generated(
    target: Loaded, prompts: list[list[int]], max_new_tokens: int, seeds: list[int | None]
) -> list[Sequence]:
    """`generate` by one batched `model.generate`."""
    sample = seeds[0] is not None
    require(all((seed is not None) == sample for seed in seeds), "one model.generate samples every reply or none")
    if sample:
        torch.manual_seed(seeds[0])
    got = answer(target, prompts, max_new_tokens, SAMPLED if sample else None, output_hidden_states=True)
    # per step, every layer's states; the last entry is after the final norm (what the LM head reads)
    states = torch.cat([step[-1] for step in got.out.hidden_states], dim=1).half().cpu()  # [B, P + G - 1, H]
    sequences = []
    for b, (p, reply) in enumerate(zip(prompts, got.replies)):
        full = p + reply
        rows = states[b, got.width - len(p) : got.width - len(p) + len(full) - 1]  # after each token but the last
        sequences.append(Sequence(torch.tensor(full, dtype=torch.int32), len(p), rows.clone()))
    return sequences


class FeatureCache(ShardFolder):
    """The replies and features of a head build (`work/features`)."""

    subfolder, key, item, what = "features", "sequences", Sequence, "the training data"

    def sequences(self) -> list[Sequence]:
        return [s for path in self.shards() for s in self.load(path)]

    def split(self, prompts: list[list[int]], batch: int) -> tuple[list[list[list[int]]], list[list[int]]]:
        """(training batches in their fixed order, held-out prompts) of the encoded prompts.

        The held-out prompts are a seeded sample; the rest are sorted by length and cut into
        batches (little padding), which are then shuffled, so that any prefix of the batches is a
        fair sample of the prompts.
        """
        rng = random.Random(self.plan.seed)
        order = list(range(len(prompts)))
        rng.shuffle(order)
        held = min(self.plan.heldout, len(prompts) // 2)
        train = sorted((prompts[i] for i in order[held:]), key=len)
        batches = [train[i : i + batch] for i in range(0, len(train), batch)]
        rng.shuffle(batches)
        return batches, [prompts[i] for i in order[:held]]

    def fill(
        self, target: Loaded, texts: list[str], batch: int, deadline: float, log=print, runner: Runner | None = None
    ) -> None:
        """Write the held-out shard, then one shard per `batch` training prompts (their greedy replies and the
        plan's sampled ones) until all are done or `deadline` (time.monotonic) passes (at least one new shard
        per call). `runner`: a static runner of the target to decode on, forked for each reply decoded together
        (an engine's, in its arithmetic); default: new runners of `target.model` in fp32."""
        tok, limit = target.tokenizer, self.plan.max_prompt_tokens
        encoded = [chat_ids(tok, [{"role": "user", "content": t}], True) for t in texts]
        encoded = [e for e in encoded if len(e) <= limit]  # longer prompts cost more prefill than they teach
        batches, held = self.split(encoded, batch)
        heldout = self.folder / "heldout.pt"
        done = len(self.shards())
        if heldout.is_file() and done == len(batches):
            return  # all made: no runners to set up
        width = min(batch, max(map(len, batches + [held])))  # replies decoded together
        first = runner or Runner(target.model)  # static runners decode them in the engine's batch (module docstring)
        more = (first.fork() if runner else Runner(target.model) for _ in range(width - 1))
        runners = [first, *more] if first.static is not None else None
        if not heldout.is_file():
            self._write(heldout, target, sorted(held, key=len), width, runners, log, "held-out set", sampled=0)
        for i in range(done, len(batches)):
            if i > done and time.monotonic() > deadline:
                break
            self._write(
                self.folder / f"shard-{i:05d}.pt",
                target,
                batches[i],
                width,
                runners,
                log,
                f"data shard {i + 1}/{len(batches)}",
                index=i,
            )

    def _write(
        self,
        path: Path,
        target: Loaded,
        prompts: list[list[int]],
        group: int,
        runners: list[Runner] | None,
        log,
        what: str,
        sampled: int | None = None,
        index: int = 0,
    ) -> None:
        """One shard: the greedy replies to `prompts` (`group` decoded together, on `runners` when given) and
        `sampled` (default: the plan's) sampled replies each, seeded by (plan seed, shard `index`, reply)."""
        t0 = time.monotonic()
        sequences = []
        base = random.Random(f"{self.plan.seed}:{index}").getrandbits(30)
        for k in range(1 + (self.plan.sampled if sampled is None else sampled)):
            for i in range(0, len(prompts), group):
                chunk = prompts[i : i + group]
                seeds = (
                    [None] * len(chunk) if k == 0 else [base + (k * len(prompts) + i + j) for j in range(len(chunk))]
                )
                sequences += generate(target, chunk, self.plan.max_new_tokens, seeds, runners)
        with atomic_path(path) as tmp:
            torch.save({"sequences": [asdict(s) for s in sequences]}, tmp)
        made = sum(len(s.ids) - s.start for s in sequences)
        took = time.monotonic() - t0
        log(
            f"{what}: {len(sequences)} replies, {made} new tokens in {took:.0f}s ({made / max(took, 1e-9):.0f} "
            f"tokens/s)"
        )
