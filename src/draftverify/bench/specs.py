"""The bench's method specs: the shared grammar (`draftverify.methods.spec`) plus the peers.

A bench spec is any method spec (`name`, `name:preset`, `name[key=value,...]`, ...) whose
`name` is a method in `draftverify.methods.METHODS` or a peer, a decoding another engine runs:

- `hf-assisted`: assisted generation, `generate(assistant_model=<the engine's draft>)`;
  options `num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold`
  (unset ones keep transformers' defaults, read from the draft's generation config);
- `hf-prompt-lookup`: prompt lookup decoding, `generate(prompt_lookup_num_tokens=...)`;
  options `prompt_lookup_num_tokens` (default 10) and `max_matching_ngram_size`;
- `hf-autoregressive`: plain `generate()` (the stock model, transformers' own decoding loop);
- `llamacpp`: llama.cpp's plain decoding of an F32 GGUF of the target's weights, and
  `llamacpp-prompt-lookup`: its prompt-lookup speculative decoding, option `num_pred_tokens`
  (default 10); both need the optional llama-cpp-python (bench/llamacpp.py).

The bench option `warm=false` (any spec) builds a fresh method instance for every
generation instead of keeping one across prompts (warm start, e.g. an n-gram pool).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftverify.errors import DraftVerifyError, require
from draftverify.methods import METHODS
from draftverify.methods.spec import MethodSpec, read_spec, refuse_duplicates, split_specs

BASELINE = "autoregressive"


@dataclass(frozen=True)
class AssistedConfig:
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str | None = None  # constant | heuristic | heuristic_transient
    assistant_confidence_threshold: float | None = None

    def __post_init__(self):
        n, schedule, threshold = (
            self.num_assistant_tokens,
            self.num_assistant_tokens_schedule,
            self.assistant_confidence_threshold,
        )
        require(n is None or (isinstance(n, int) and n >= 1), f"num_assistant_tokens={n} must be an integer >= 1")
        require(
            schedule in (None, "constant", "heuristic", "heuristic_transient"),
            f"num_assistant_tokens_schedule={schedule!r} is unknown: use constant, heuristic or heuristic_transient",
        )
        require(
            threshold is None or 0 <= threshold <= 1, f"assistant_confidence_threshold={threshold} must lie in [0, 1]"
        )


@dataclass(frozen=True)
class PromptLookupConfig:
    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int | None = None  # transformers' default: 2

    def __post_init__(self):
        n, m = self.prompt_lookup_num_tokens, self.max_matching_ngram_size
        require(isinstance(n, int) and n >= 1, f"prompt_lookup_num_tokens={n} must be an integer >= 1")
        require(m is None or (isinstance(m, int) and m >= 1), f"max_matching_ngram_size={m} must be an integer >= 1")


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class LlamaCppLookupConfig:
    num_pred_tokens: int = 10

    def __post_init__(self):
        n = self.num_pred_tokens
        require(isinstance(n, int) and n >= 1, f"num_pred_tokens={n} must be an integer >= 1")


@dataclass(frozen=True)
class Peer:
    """A decoding method another engine implements: transformers' `generate` or llama.cpp."""

    name: str
    Config: type
    needs_draft: bool
    presets: dict = dataclasses.field(default_factory=dict)
    engine: str = "transformers"  # transformers | llama.cpp (other kernels: exactness not expected)


PEERS = {
    "hf-assisted": Peer(
        "hf-assisted",
        AssistedConfig,
        needs_draft=True,
        presets={"heuristic": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic"}},
    ),
    "hf-prompt-lookup": Peer("hf-prompt-lookup", PromptLookupConfig, needs_draft=False),
    "hf-autoregressive": Peer("hf-autoregressive", NoOptions, needs_draft=False),
    "llamacpp": Peer("llamacpp", NoOptions, needs_draft=False, engine="llama.cpp"),
    "llamacpp-prompt-lookup": Peer(
        "llamacpp-prompt-lookup", LlamaCppLookupConfig, needs_draft=False, engine="llama.cpp"
    ),
}


@dataclass(frozen=True)
class BenchSpec(MethodSpec):
    """A spec as the bench runs it: `options` as written (`warm` included), the validated Config."""

    config: object = None  # the method's (or peer's) validated Config
    warm: bool = True  # keep one method instance across prompts

    @property
    def is_peer(self) -> bool:
        return self.name in PEERS

    @property
    def engine(self) -> str:
        """Who decodes: draftverify, transformers or llama.cpp."""
        return PEERS[self.name].engine if self.is_peer else "draftverify"

    @property
    def needs_draft(self) -> bool:
        return PEERS[self.name].needs_draft if self.is_peer else METHODS[self.name].needs_draft

    @property
    def loads_draft(self) -> bool:
        """Whether the engine should load the default drafts for it (it needs or may use them)."""
        return PEERS[self.name].needs_draft if self.is_peer else METHODS[self.name].loads_draft()

    @property
    def takes_head(self) -> bool:
        return not self.is_peer and METHODS[self.name].takes_head

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE and self.preset is None and not self.options


def parse_spec(text: str) -> BenchSpec:
    """One bench spec: a method's or a peer's, with the bench option `warm`."""
    spec = read_spec(text)
    settings = dict(spec.options)
    warm = settings.pop("warm", True)
    require(isinstance(warm, bool), f"warm={warm!r} in {text!r} must be true or false")
    if spec.name in PEERS:
        config = peer_config(PEERS[spec.name], spec.preset, settings)
    elif spec.name in METHODS:
        config = METHODS[spec.name].make_config(spec.preset, **settings)
    else:
        raise DraftVerifyError(
            f"unknown method {spec.name!r} in --methods: use one of {', '.join(sorted([*METHODS, *PEERS]))}"
        )
    return BenchSpec(spec.label, spec.name, spec.preset, spec.options, config, warm)


def peer_config(peer: Peer, preset: str | None, settings: dict):
    values = {}
    if preset is not None:
        require(
            preset in peer.presets,
            f"unknown preset {preset!r} for {peer.name}: use one of {', '.join(peer.presets) or 'none'}",
        )
        values.update(peer.presets[preset])
    fields = {f.name for f in dataclasses.fields(peer.Config)}
    for key in settings:
        require(
            key in fields, f"unknown option {key!r} for {peer.name}: it takes {', '.join(sorted(fields))} (and warm)"
        )
    values.update(settings)
    return peer.Config(**values)


def parse_specs(text: str) -> list[BenchSpec]:
    """The comma-separated specs, with the autoregressive baseline first (added when missing)."""
    specs = [parse_spec(part) for part in split_specs(text)]
    refuse_duplicates(specs)
    base = [s for s in specs if s.is_baseline]
    return (base or [parse_spec(BASELINE)]) + [s for s in specs if not s.is_baseline]
