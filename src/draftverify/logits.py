"""What the target's logits go through before sampling, as a function of the tokens so far: OpenAI's
presence / frequency penalties and logit_bias, a grammar (JSON schema, regex, Lark), and the logprobs
of the emitted tokens.

Each verified tree node knows its prefix (the request's output, which ends with the root, then the
node's path), so the processed logits after every node are exactly what autoregressive decoding would
process at that point. The verifier then judges drafts against the processed distribution: greedy
takes its argmax, sampling its distribution (a draft the grammar forbids has probability 0 there and
is rejected). Drafts need not be processed for exactness; `draft_logits` processes a draft model's
for better acceptance.

Penalties count the generated tokens only (as vLLM and llama.cpp's server do), not the prompt's:
    logits[j] -= frequency * count[j] + presence * (count[j] > 0);  logits[j] += logit_bias[j]
Logprobs are log_softmax of the processed logits (penalties, bias and grammar applied; temperature,
top-k, top-p and min-p not), computed row by row so that every method reports the same bits for the
same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftverify.errors import DraftVerifyError, require


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0  # OpenAI's presence_penalty, in [-2, 2]
    frequency: float = 0.0  # OpenAI's frequency_penalty, in [-2, 2]
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit in [-100, 100])

    def __post_init__(self):
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            require(-2 <= value <= 2, f"{name}={value} is outside [-2, 2]: use a value in that range, or 0")
        for token, value in self.bias:
            require(isinstance(token, int) and token >= 0, f"logit_bias key {token!r} is not a token id: use ids >= 0")
            require(-100 <= value <= 100, f"logit_bias[{token}]={value} is outside [-100, 100]: use that range")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.bias)


@dataclass
class Logprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the likeliest tokens and their logprobs, likeliest first


@dataclass
class Processor:
    """One request's prefix-dependent processing (`Session.processor`). `top_logprobs`: None records no
    logprobs, k >= 0 records each emitted token's logprob and the k likeliest."""

    penalties: Penalties = field(default_factory=Penalties)
    grammar: object = None  # a constraints.Grammar
    top_logprobs: int | None = None
    logprobs: list[Logprob] = field(default_factory=list)

    def __post_init__(self):
        require(
            self.top_logprobs is None or 0 <= self.top_logprobs <= 20,
            f"top_logprobs={self.top_logprobs} is outside [0, 20]: ask for at most 20",
        )

    @property
    def changes_logits(self) -> bool:
        return self.penalties.active or self.grammar is not None

    def tree(self, output: list[int], tokens: list[int], parents: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] after each node of a trie (node 0 = the root, output's last token) -> processed [n, V]."""
        if not self.changes_logits:
            return logits
        paths: list[list[int]] = [[]]
        for i in range(1, len(tokens)):
            paths.append(paths[parents[i]] + [tokens[i]])
        return self.rows(output, paths, logits)

    def rows(self, output: list[int], paths: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        """Logits [n, V], row i after output + paths[i] -> processed [n, V] (fp32)."""
        if not self.changes_logits:
            return logits
        logits = logits.float().clone()
        if self.penalties.active:
            logits = self._penalise(output, paths, logits)
        if self.grammar is not None:
            allowed = self.grammar.allowed(output, paths, logits.shape[-1]).to(logits.device)  # [n, V] bool
            logits = logits.masked_fill(~allowed, float("-inf"))
        return logits

    def _penalise(self, output: list[int], paths: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        n, v = logits.shape
        counts = torch.zeros(n, v, device=logits.device)  # [n, V] generated-token counts per row
        if output:
            counts += torch.bincount(torch.tensor(output, device=logits.device), minlength=v)[:v].float()
        for i, path in enumerate(paths):
            if path:
                counts[i] += torch.bincount(torch.tensor(path, device=logits.device), minlength=v)[:v].float()
        pen = self.penalties
        logits = logits - pen.frequency * counts - pen.presence * (counts > 0).float()
        for token, value in pen.bias:
            if token < v:
                logits[:, token] += value
        return logits

    def record(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """Logprobs of `tokens`, token i drawn after the processed logits [len(tokens), V] row i."""
        if self.top_logprobs is None:
            return
        for row, token in zip(logits, tokens):
            lp = torch.log_softmax(row.float().clone(), -1)  # [V], one row at a time: the same bits for every method
            top = []
            if self.top_logprobs:
                values, ids = lp.topk(self.top_logprobs)
                top = list(zip(ids.tolist(), values.tolist()))
            self.logprobs.append(Logprob(token, float(lp[token]), top))


def draft_logits(s, drafted: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A draft model's logits [V] after the output + `drafted` -> processed as the target's would be there."""
    processor = getattr(s, "processor", None)
    if processor is None or not processor.changes_logits:
        return logits
    return processor.rows(s.output, [drafted], logits[None])[0]


KNOBS = ("presence_penalty", "frequency_penalty", "logit_bias", "response_format", "logprobs", "top_logprobs")


def make_processor(options: dict, tokenizer, eos: tuple[int, ...]) -> Processor | None:
    """Take this module's knobs out of a request's `options` (KNOBS; `logprobs` True or `top_logprobs` k asks for
    logprobs) -> the request's Processor, or None when none is set."""
    knobs = {k: options.pop(k) for k in KNOBS if k in options}
    bias = knobs.get("logit_bias") or {}
    require(isinstance(bias, dict), "logit_bias must map token ids to values: e.g. {'50256': -100}")
    try:
        pairs = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
    except (TypeError, ValueError):
        raise DraftVerifyError("logit_bias keys must be token ids and values numbers: e.g. {'50256': -100}") from None
    penalties = Penalties(knobs.get("presence_penalty") or 0.0, knobs.get("frequency_penalty") or 0.0, pairs)
    grammar = None
    fmt = knobs.get("response_format")
    if fmt is not None:
        from draftverify.constraints import Format, Grammar, parse_response_format

        fmt = fmt if isinstance(fmt, Format) else parse_response_format(fmt)
        grammar = None if fmt is None else Grammar(fmt, tokenizer, eos)
    top = knobs.get("top_logprobs")
    top = top if top is not None else (0 if knobs.get("logprobs") else None)
    if not penalties.active and grammar is None and top is None:
        return None
    return Processor(penalties, grammar, top)
