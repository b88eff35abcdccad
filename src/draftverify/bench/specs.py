"""Method specs on the bench command line, and the transformers peers.

A spec is `name`, `name:preset`, `name[key=value,...]` or `name:preset[key=value,...]`;
several are separated by commas (commas inside brackets belong to the spec). The spec
string itself is the label in every report. `name` is any method in
`draftverify.methods.METHODS` or a peer run through transformers' own `generate`:

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
import json
import re
from dataclasses import dataclass

from draftverify.errors import DraftVerifyError, require
from draftverify.methods import METHODS

SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_\-]+)(?::(?P<preset>[A-Za-z0-9_\-.]+))?(?:\[(?P<options>[^\[\]]*)\])?$")
BASELINE = "autoregressive"


@dataclass(frozen=True)
class AssistedConfig:
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str | None = None  # constant | heuristic | heuristic_transient
    assistant_confidence_threshold: float | None = None

    def __post_init__(self):
        n, schedule, threshold = self.num_assistant_tokens, self.num_assistant_tokens_schedule, self.assistant_confidence_threshold
        require(n is None or (isinstance(n, int) and n >= 1), f"num_assistant_tokens={n} must be an integer >= 1")
        require(
            schedule in (None, "constant", "heuristic", "heuristic_transient"),
            f"num_assistant_tokens_schedule={schedule!r} is unknown: use constant, heuristic or heuristic_transient",
        )
        require(threshold is None or 0 <= threshold <= 1, f"assistant_confidence_threshold={threshold} must lie in [0, 1]")


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
    "hf-assisted": Peer("hf-assisted", AssistedConfig, needs_draft=True, presets={"heuristic": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic"}}),
    "hf-prompt-lookup": Peer("hf-prompt-lookup", PromptLookupConfig, needs_draft=False),
    "hf-autoregressive": Peer("hf-autoregressive", NoOptions, needs_draft=False),
    "llamacpp": Peer("llamacpp", NoOptions, needs_draft=False, engine="llama.cpp"),
    "llamacpp-prompt-lookup": Peer("llamacpp-prompt-lookup", LlamaCppLookupConfig, needs_draft=False, engine="llama.cpp"),
}


@dataclass(frozen=True)
class MethodSpec:
    label: str  # the spec string as written: the name in every report
    name: str
    preset: str | None
    options: tuple[tuple[str, object], ...]  # explicit options, in the order written
    config: object  # the method's (or peer's) validated Config
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
    def is_baseline(self) -> bool:
        return self.name == BASELINE and self.preset is None and not self.options


def split_specs(text: str) -> list[str]:
    """'a,b[k=1,x=2],c' -> ['a', 'b[k=1,x=2]', 'c'] (commas inside brackets stay)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        require(depth in (0, 1), f"bad brackets in --methods {text!r}: write e.g. speculative[k=4,policy=heuristic]")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    require(depth == 0, f"unclosed '[' in --methods {text!r}: write e.g. speculative[k=4]")
    parts.append(current.strip())
    return [p for p in parts if p]


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_spec(text: str) -> MethodSpec:
    match = SPEC.match(text.strip())
    require(match is not None, f"bad method spec {text!r}: write name, name:preset, name[key=value,...] or name:preset[key=value]")
    name, preset, option_text = match["name"], match["preset"], match["options"]
    options = []
    for pair in (option_text or "").split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        require(sep and key.strip(), f"bad option {pair!r} in method spec {text!r}: write key=value")
        options.append((key.strip().replace("-", "_"), _value(value.strip())))
    settings = dict(options)
    warm = settings.pop("warm", True)
    require(isinstance(warm, bool), f"warm={warm!r} in {text!r} must be true or false")
    if name in PEERS:
        config = peer_config(PEERS[name], preset, settings)
    elif name in METHODS:
        config = METHODS[name].make_config(preset, **settings)
    else:
        raise DraftVerifyError(f"unknown method {name!r} in --methods: use one of {', '.join(sorted([*METHODS, *PEERS]))}")
    return MethodSpec(text.strip(), name, preset, tuple(options), config, warm)


def peer_config(peer: Peer, preset: str | None, settings: dict):
    values = {}
    if preset is not None:
        require(preset in peer.presets, f"unknown preset {preset!r} for {peer.name}: use one of {', '.join(peer.presets) or 'none'}")
        values.update(peer.presets[preset])
    fields = {f.name for f in dataclasses.fields(peer.Config)}
    for key in settings:
        require(key in fields, f"unknown option {key!r} for {peer.name}: it takes {', '.join(sorted(fields))} (and warm)")
    values.update(settings)
    return peer.Config(**values)


def parse_specs(text: str) -> list[MethodSpec]:
    """The comma-separated specs, with the autoregressive baseline first (added when missing)."""
    specs = [parse_spec(part) for part in split_specs(text)]
    labels = [s.label for s in specs]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    require(duplicate is None, f"method spec {duplicate!r} is listed twice in --methods: drop one")
    base = [s for s in specs if s.is_baseline]
    return (base or [parse_spec(BASELINE)]) + [s for s in specs if not s.is_baseline]
