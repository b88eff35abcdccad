"""One request in flight: its settings, its output so far, and where it must stop.

Methods hand every chunk of accepted tokens to `Session.emit`, which appends them one by
one and applies the stopping rules per token — max_new_tokens, EOS ids, stop strings — so
a stop that lands inside an accepted chunk ends the output exactly where autoregressive
decoding would. It also streams the tokens out and records the stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from draftverify.detokenize import Detokenizer
from draftverify.errors import require
from draftverify.sampling import Sampling
from draftverify.stats import Stats


@dataclass(frozen=True)
class Stopping:
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        require(self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be at least 1")
        require(all(s for s in self.stop_strings), "a stop string is empty: drop it or give some text")


@dataclass
class Session:
    prompt: list[int]
    sampling: Sampling
    stopping: Stopping
    tokenizer: object = None  # needed for stop strings
    streamer: object = None  # transformers-style: put(tensor), end()
    on_tokens: Callable[[list[int]], bool | None] | None = None  # return False to cancel
    stats: Stats = field(default_factory=Stats)
    output: list[int] = field(default_factory=list)
    done: bool = False
    stop_text_at: int | None = None  # where the first stop string starts in the decoded text
    processor: object = None  # a logits.Processor: penalties, logit_bias, a grammar, logprobs (None: none)
    provenance: bool = False  # have the round say who drafted the tokens it emits (`drafted_by`; serve/provenance.py)
    drafted_by: list[str] = field(default_factory=list)  # with provenance: the drafter of each of the first tokens
    # of the chunk being emitted (the accepted drafted ones); the chunk's other tokens are the target's own
    prefix_cache: object = None  # the engine's prefix_cache.PrefixCache (None: every prompt prefilled whole)
    others: int = 0  # rows the rest of the batch fed to the last shared forward (0: decoding alone; `batch`)
    step_rows: int = 0  # the most rows its next forward may feed: the batch's gap budget (0: no bound; `batch`)
    _generators: dict = field(default_factory=dict)
    _decoded: Detokenizer | None = None  # the output's text token by token, for stop strings

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The request's random source on `device`, created once (seeded per device) and never reseeded."""
        device = torch.device(device)
        key = str(device)
        if key not in self._generators:
            seed = self.sampling.seed
            gen = torch.Generator(device=device)
            gen.manual_seed(seed + len(self._generators)) if seed is not None else gen.seed()
            self._generators[key] = gen
        return self._generators[key]

    @property
    def remaining(self) -> int:
        return self.stopping.max_new_tokens - len(self.output)

    def emit(self, tokens: list[int]) -> bool:
        """Append accepted tokens, stopping early where a stop rule fires. Returns False once done."""
        if self.done:
            return False
        now = self.stats.elapsed()
        kept = []
        for token in tokens:
            kept.append(token)
            self.output.append(token)
            reason = self._stop_reason(token)
            if reason:
                self.done, self.stats.finish_reason = True, reason
                break
        if self.stats.ttft_s is None:
            self.stats.ttft_s = now
        self.stats.token_times.extend([now] * len(kept))
        self.stats.new_tokens = len(self.output)
        if self.streamer is not None:
            self.streamer.put(torch.tensor([kept]))
        if self.on_tokens is not None and self.on_tokens(kept) is False and not self.done:
            self.done, self.stats.finish_reason = True, "cancelled"
        return not self.done

    def _stop_reason(self, token: int) -> str:
        if token in self.stopping.eos_token_ids:
            return "eos"
        if self.stopping.stop_strings:
            if self._decoded is None:
                self._decoded = Detokenizer(self.tokenizer)
            text = self._decoded.extend(self.output[len(self._decoded.tokens) :])
            hits = [text.find(s) for s in self.stopping.stop_strings if s in text]
            if hits:
                self.stop_text_at = min(hits)
                return "stop"
        if len(self.output) >= self.stopping.max_new_tokens:
            return "length"
        return ""

    def text(self) -> str:
        text = self.tokenizer.decode(self.output, skip_special_tokens=True)
        return text if self.stop_text_at is None else text[: self.stop_text_at]
