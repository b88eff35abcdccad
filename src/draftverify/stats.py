"""The per-request stats record and its derived figures.

Formulas (also in docs/metrics.md):
- tokens_per_s            = new_tokens / wall_s
- accepted_per_forward    = new_tokens / target_forwards (the prefill forward counts; it
                            yields the first token). Autoregressive decoding scores exactly 1.
- mean_accepted_per_step  = mean of `steps` = accepted drafted tokens + 1 (the bonus or
                            corrected token) per verification forward.
- acceptance_rate         = accepted / drafted (None when nothing was drafted: unknown, not 0)
- discarded_per_token     = (drafted - accepted) / new_tokens
- time split              = draft_s, verify_s, other_s = wall_s - draft_s - verify_s
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Stats:
    method: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled (`prefix_cache`)
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0  # drafted tokens sent to verification (tree nodes for tree methods)
    accepted: int = 0  # drafted tokens accepted (excludes the bonus/corrected token)
    steps: list[int] = field(default_factory=list)  # tokens emitted per verification, bonus included
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    ttft_s: float | None = None  # time to first emitted token
    token_times: list[float] = field(default_factory=list)  # seconds from start, per emitted token
    finish_reason: str = ""  # "length", "eos", "stop" or "cancelled"
    extra: dict = field(default_factory=dict)  # method-specific counters
    sync_device: torch.device | None = None  # synchronise CUDA around timed phases

    _t0: float = field(default=0.0, repr=False)

    def verified(self, drafted: int, accepted: int, emitted: int) -> None:
        """Count one verifying target forward: `drafted` candidate tokens, `accepted` of them, `emitted` tokens out."""
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        self.steps.append(emitted)

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    @contextmanager
    def timer(self, phase: str):
        """Add the time spent inside the block to `{phase}_s`."""
        self._sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + time.perf_counter() - t)

    def _sync(self) -> None:
        if self.sync_device is not None and self.sync_device.type == "cuda":
            torch.cuda.synchronize(self.sync_device)

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def accepted_per_forward(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        return sum(self.steps) / len(self.steps) if self.steps else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def discarded_per_token(self) -> float | None:
        return (self.drafted - self.accepted) / self.new_tokens if self.new_tokens else None

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.draft_s - self.verify_s)

    def to_dict(self, timings: bool = True) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_") and k != "sync_device"}
        if not timings:
            out.pop("token_times")
        for name in (
            "tokens_per_s",
            "accepted_per_forward",
            "mean_accepted_per_step",
            "acceptance_rate",
            "discarded_per_token",
            "other_s",
        ):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        def fmt(x, spec=".2f"):
            return "n/a" if x is None else format(x, spec)

        return (
            f"{self.method}: {self.new_tokens} tokens in {self.wall_s:.2f}s ({fmt(self.tokens_per_s, '.1f')} tok/s); "
            f"target forwards {self.target_forwards}, draft forwards {self.draft_forwards}; "
            f"tokens/target forward {fmt(self.accepted_per_forward)}; acceptance {fmt(self.acceptance_rate)}; "
            f"time draft {self.draft_s:.2f}s / verify {self.verify_s:.2f}s / other {self.other_s:.2f}s"
        )
