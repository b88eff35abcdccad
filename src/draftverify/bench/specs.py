"""The bench's method specs: the shared grammar (`draftverify.methods.spec`) plus the peers.

A bench spec is any method spec (`name`, `name:preset`, `name[key=value,...]`, ...) whose
`name` is a method in `draftverify.methods.METHODS` or a peer, a decoding another engine runs:

- `hf-assisted`: assisted generation, `generate(assistant_model=<the engine's draft>)`;
  options `num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold`
  (unset ones keep transformers' defaults, read from the draft's generation config);
- `hf-prompt-lookup`: prompt lookup decoding, `generate(prompt_lookup_num_tokens=...)`;
  options `prompt_lookup_num_tokens` (default 10) and `max_matching_ngram_size`;
- `hf-autoregressive`: plain `generate()` (the stock model, transformers' own decoding loop);
- `llamacpp`: llama.cpp's plain decoding of the target's own GGUF file (the file a llama.cpp
  user runs), `llamacpp-f32`: the same on an F32 re-export of the target's weights (the same
  arithmetic as draftverify's fp32 path), and `llamacpp-prompt-lookup`: its prompt-lookup
  speculative decoding on the target's own file, option `num_pred_tokens` (default 10); all need
  the optional llama-cpp-python (bench/llamacpp.py).

Peers are configured exactly as methods are (`Method.make_config`: a preset, then the options,
validated by the Config), and `entry(name)` is the one view of what a bench spec may name: the
methods of `draftverify.methods.METHODS` (the standalone drafters included) and the peers.

The bench option `warm=false` (any spec) builds a fresh method instance for every
generation instead of keeping one across prompts (warm start, e.g. an n-gram pool).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftverify.errors import DraftVerifyError, require
from draftverify.methods import METHODS, Method
from draftverify.methods.base import Artifact, Drafts
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
class HfPromptLookupConfig:
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
    """A decoding method another engine implements: transformers' `generate` or llama.cpp.

    It answers what the bench asks of a method class (`name`, `Config`, `presets`, `drafts`, `make_config`), so a
    spec reads the same whichever it names."""

    name: str
    Config: type
    drafts_with: Drafts = Drafts()
    presets: dict = dataclasses.field(default_factory=dict)
    engine: str = "transformers"  # transformers | llama.cpp (other kernels: exactness not expected)
    gguf: str | None = None  # llama.cpp peers: "file" (the target's own GGUF) or "f32" (its F32 re-export)

    def drafts(self, config=None) -> Drafts:
        return self.drafts_with

    def make_config(self, preset: str | None = None, **overrides):
        """The Config from a preset plus overrides: the very code that builds a method's config."""
        return Method.make_config.__func__(self, preset, **overrides)


PEERS = {
    "hf-assisted": Peer(
        "hf-assisted",
        AssistedConfig,
        Drafts((Artifact.DRAFT_MODEL,), required=True),
        presets={"heuristic": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic"}},
    ),
    "hf-prompt-lookup": Peer("hf-prompt-lookup", HfPromptLookupConfig),
    "hf-autoregressive": Peer("hf-autoregressive", NoOptions),
    "llamacpp": Peer("llamacpp", NoOptions, engine="llama.cpp", gguf="file"),
    "llamacpp-f32": Peer("llamacpp-f32", NoOptions, engine="llama.cpp", gguf="f32"),
    "llamacpp-prompt-lookup": Peer("llamacpp-prompt-lookup", LlamaCppLookupConfig, engine="llama.cpp", gguf="file"),
}


def names() -> list[str]:
    """Every name a bench spec may use: the methods (standalone drafters included) and the peers."""
    return sorted([*METHODS, *PEERS])


def entry(name: str):
    """What `name` runs: a method class of `METHODS` or a `Peer`, both answering the same questions."""
    found = PEERS.get(name) or METHODS.get(name)
    if found is None:
        raise DraftVerifyError(f"unknown method {name!r} in --methods: use one of {', '.join(names())}")
    return found


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
    def gguf(self) -> str | None:
        """Which GGUF a llama.cpp peer runs: "file" (the target's own) or "f32" (its F32 re-export)."""
        return PEERS[self.name].gguf if self.is_peer else None

    @property
    def drafts(self) -> Drafts:
        """What it drafts with (`Method.drafts` of its config)."""
        return entry(self.name).drafts(self.config)

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE and self.preset is None and not self.options


def parse_spec(text: str) -> BenchSpec:
    """One bench spec: a method's or a peer's, with the bench option `warm`."""
    spec = read_spec(text)
    settings = dict(spec.options)
    warm = settings.pop("warm", True)
    require(isinstance(warm, bool), f"warm={warm!r} in {text!r} must be true or false")
    config = entry(spec.name).make_config(spec.preset, **settings)
    return BenchSpec(spec.label, spec.name, spec.preset, spec.options, config, warm)


def parse_specs(text: str) -> list[BenchSpec]:
    """The comma-separated specs, with the autoregressive baseline first (added when missing)."""
    specs = [parse_spec(part) for part in split_specs(text)]
    refuse_duplicates(specs)
    base = [s for s in specs if s.is_baseline]
    return (base or [parse_spec(BASELINE)]) + [s for s in specs if not s.is_baseline]
