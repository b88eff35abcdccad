"""Training data for a feature-level draft head: the target's own replies and its hidden states.

For instruction prompts (one JSON object per line with a "prompt" field, e.g.
`../shared/data/train_prompts/prompts.jsonl`), the target writes its greedy reply (batched
`model.generate`); its last hidden
state (after the final norm: what its LM head reads) at every position comes out of the same
generate. A `Sequence` stores the token ids and those features in fp16; feature t predicts
token t + 1 through the LM head.

Shards (`shard-NNNNN.pt`) are written atomically, one per batch of prompts in a fixed seeded
order, so an interrupted build keeps every finished shard and a resumed one continues with the
next prompts. A fixed slice of the prompts is held out (`heldout.pt`) to measure acceptance.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.models import Loaded
from draftverify.tools.make_draft.data import ShardFolder, chat_ids, left_padded
from draftverify.util import atomic_path


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


def read_prompts(path: Path) -> list[str]:
    """The "prompt" fields of a JSON-lines file, refusing a malformed one with a one-line error."""
    require(path.is_file(), f"prompt file {path} does not exist: pass --prompts FILE (JSON lines with a 'prompt' field)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DraftVerifyError(f"{path} line {n} is not a JSON object with a 'prompt' field: fix or remove it") from exc
        require(isinstance(prompt, str) and prompt.strip(), f"{path} line {n}: 'prompt' must be a non-empty string")
        prompts.append(prompt)
    require(len(prompts) >= 2, f"{path} holds {len(prompts)} prompts: a head needs hundreds")
    return prompts


@torch.inference_mode()
def generate(target: Loaded, prompts: list[list[int]], max_new_tokens: int) -> list[Sequence]:
    """The target's greedy replies to `prompts` (one batched generate), each cut after its first EOS,
    with the final hidden states the generate computed on the way (no second forward)."""
    from transformers import GenerationConfig

    ids, mask, pad, eos = left_padded(target, prompts)  # [B, P]
    width = ids.shape[1]
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                              pad_token_id=pad, eos_token_id=eos, output_hidden_states=True, return_dict_in_generate=True)
    out = target.model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device), generation_config=config)
    # per step, every layer's states; the last entry is after the final norm (what the LM head reads)
    states = torch.cat([step[-1] for step in out.hidden_states], dim=1).half().cpu()  # [B, P + G - 1, H]
    new = out.sequences[:, width:].tolist()
    sequences = []
    for b, p in enumerate(prompts):
        reply = new[b][: next((j + 1 for j, t in enumerate(new[b]) if t in eos), len(new[b]))]
        full = p + reply
        rows = states[b, width - len(p) : width - len(p) + len(full) - 1]  # after each token but the last
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

    def fill(self, target: Loaded, texts: list[str], batch: int, deadline: float, log=print) -> None:
        """Write the held-out shard, then one shard per `batch` training prompts until all are done or
        `deadline` (time.monotonic) passes (at least one new shard per call)."""
        tok, limit = target.tokenizer, self.plan.max_prompt_tokens
        encoded = [chat_ids(tok, [{"role": "user", "content": t}], True) for t in texts]
        encoded = [e for e in encoded if len(e) <= limit]  # longer prompts cost more prefill than they teach
        batches, held = self.split(encoded, batch)
        heldout = self.folder / "heldout.pt"
        if not heldout.is_file():
            self._write(heldout, target, sorted(held, key=len), batch, log, "held-out set")
        done = len(self.shards())
        for i in range(done, len(batches)):
            if i > done and time.monotonic() > deadline:
                break
            self._write(self.folder / f"shard-{i:05d}.pt", target, batches[i], batch, log, f"data shard {i + 1}/{len(batches)}")

    def _write(self, path: Path, target: Loaded, prompts: list[list[int]], batch: int, log, what: str) -> None:
        t0 = time.monotonic()
        sequences = []
        for i in range(0, len(prompts), batch):
            sequences += generate(target, prompts[i : i + batch], self.plan.max_new_tokens)
        with atomic_path(path) as tmp:
            torch.save({"sequences": [asdict(s) for s in sequences]}, tmp)
        made = sum(len(s.ids) - s.start for s in sequences)
        took = time.monotonic() - t0
        log(f"{what}: {len(sequences)} replies, {made} new tokens in {took:.0f}s ({made / max(took, 1e-9):.0f} tokens/s)")
