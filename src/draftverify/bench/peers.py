"""The transformers peers, run through `model.generate` exactly as a user would call it.

What can be observed from outside `generate` is measured: the target's and the draft's
forward calls (forward pre-hooks), the tokens emitted per target forward (the streamer gets
one chunk per verification), the drafted tokens (each verification forward asks for
`logits_to_keep` = drafted + 1 logits), and the arrival time of every chunk. The split of
the time between drafting and verifying is not observable: it is None ("unknown", not 0).
In transformers the prompt's forward also verifies the first drafts, so every target
forward is a verification step.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from contextlib import ExitStack

import torch

from draftverify.bench.measure import ChunkClock, ForwardCounter, sync
from draftverify.bench.specs import BenchSpec
from draftverify.sampling import Sampling


class PeerState:
    """A transformers peer and what it keeps across prompts: the assistant's generation config
    (transformers' "heuristic" schedule stores the adapted number of assistant tokens there between calls)."""

    def __init__(self, spec: BenchSpec, target: torch.nn.Module, draft: torch.nn.Module | None):
        self.spec, self.target, self.draft = spec, target, draft
        self.assistant_config = None
        if spec.name == "hf-assisted":
            self.assistant_config = copy.deepcopy(draft.generation_config)
            for key, value in dataclasses.asdict(spec.config).items():
                if value is not None:
                    setattr(self.assistant_config, key, value)

    def generate(self, ids: list[int], sampling: Sampling, max_new_tokens: int, eos: tuple[int, ...]) -> dict:
        """One generation (the same call as `llamacpp.LlamaCpp.generate`): the record's measured fields."""
        return run_peer(self.spec, self, self.target, self.draft, ids, sampling, max_new_tokens, eos)


def run_peer(
    spec: BenchSpec,
    state: PeerState,
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    ids: list[int],
    sampling: Sampling,
    max_new_tokens: int,
    eos: tuple[int, ...],
) -> dict:
    """Generate `ids` with a transformers peer; returns the record's measured fields."""
    device = target.get_input_embeddings().weight.device
    input_ids = torch.tensor([ids], device=device)  # [1, n]
    kwargs = dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos) or None,
        pad_token_id=eos[0] if eos else 0,
        do_sample=not sampling.greedy,
    )
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # generate() samples from the global generator
    if spec.name == "hf-assisted":
        kwargs["assistant_model"] = draft
    else:
        kwargs.update({k: v for k, v in dataclasses.asdict(spec.config).items() if v is not None})
    counts_draft = spec.name == "hf-assisted" and draft is not target  # a self-draft's calls cannot be told apart
    with ExitStack() as stack:
        target_calls = stack.enter_context(ForwardCounter(target))
        draft_calls = stack.enter_context(ForwardCounter(draft)) if counts_draft else None
        if state.assistant_config is not None:
            saved = draft.generation_config
            stack.callback(setattr, draft, "generation_config", saved)
            draft.generation_config = state.assistant_config
        sync(device)
        start = time.perf_counter()
        clock = ChunkClock(start)
        out = target.generate(input_ids, streamer=clock, **kwargs)  # [1, n + new]
        sync(device)
        wall = time.perf_counter() - start
    tokens = out[0, len(ids) :].tolist()
    if spec.name in ("hf-prompt-lookup", "hf-autoregressive"):
        draft_forwards = 0
    else:
        draft_forwards = draft_calls.calls if draft_calls is not None else None
    return _record(tokens, wall, clock, target_calls, draft_forwards, eos)


def _record(
    tokens: list[int], wall: float, clock: ChunkClock, target_calls: ForwardCounter, draft_forwards, eos
) -> dict:
    """The record's measured fields of one peer generation (the time split is unknown: None)."""
    return {
        "tokens": tokens,
        "new_tokens": len(tokens),
        "wall_s": wall,
        "ttft_s": clock.times[0] if clock.times else None,
        "token_times": clock.times,
        "target_forwards": target_calls.calls,
        "draft_forwards": draft_forwards,
        "drafted": None if None in target_calls.kept else sum(k - 1 for k in target_calls.kept),
        "accepted": sum(clock.chunks) - len(clock.chunks),
        "steps": clock.chunks,
        "draft_s": None,
        "verify_s": None,
        "finish_reason": "eos" if tokens and tokens[-1] in eos else "length",
        "extra": {},
    }
