"""The user-facing entry point: load a target (and a draft) once, generate with any method.

from draftverify import Engine
engine = Engine.load()                       # SmolLM2-135M-Instruct + its default draft
out = engine.generate("Why is the sky blue?", chat=True, max_new_tokens=64)  # method "auto"
print(out.text, out.stats.summary())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftverify import costs
from draftverify.arithmetic import ARITHMETICS, default_arithmetic, q8_linears, split_dtype
from draftverify.backend.linear import Packs
from draftverify.errors import require
from draftverify.feature_head import FeatureHead
from draftverify.loading import DraftSource, Loaded, default_feature_head, draft_source, load_draft_source, load_model
from draftverify.logits import make_processor
from draftverify.methods import Method
from draftverify.methods.base import Artifact
from draftverify.methods.spec import method_class
from draftverify.models import Runner, Shared
from draftverify.prefix_cache import PrefixCache
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping
from draftverify.stats import Stats
from draftverify.util import eos_ids


def load_target(
    target: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | None = None,
    backend: str = "auto",
) -> tuple[Loaded, str]:
    """The target as `Engine.load` loads it (a GGUF file on its direct path where it can be) and the arithmetic it
    decodes in on `backend`: `dtype`'s, or the default rule's for "auto" (`draftverify.arithmetic`)."""
    weights, arithmetic = split_dtype(dtype)
    loaded = load_model(target, dtype=weights, device=device, device_map=device_map)
    if arithmetic is None:
        opened = getattr(getattr(loaded.model, "weight_source", None), "file", None)  # a GGUF file, read once
        arithmetic, _ = default_arithmetic(loaded.source, loaded.model.device.type, backend=backend, file=opened)
    return loaded, arithmetic


@dataclass(frozen=True)
class LazyDraft:
    """A draft loaded when a method first drafts with it (`Engine.load`'s default draft): a method that does not
    (autoregressive, `auto` with a feature head) never pays for loading and packing it."""

    load: Callable[[], DraftSource | None]


@dataclass
class Result:
    tokens: list[int]  # the new tokens (the stop token included; see Session.emit)
    text: str  # decoded new tokens, cut before a stop string
    stats: Stats
    prompt_tokens: list[int]
    logprobs: list | None = None  # logits.Logprob per new token, when asked for (`logprobs` / `top_logprobs`)


class Engine:
    """A target model, an optional draft, and the methods that decode with them.

    `generate` decodes one request; `generate_batch` (and the server) decode several together, each
    in its own slot (runners with caches of their own, method instances of their own; slot 0 is
    the one `generate` uses). One caller at a time per engine: a slot's caches are not shared.
    """

    def __init__(
        self,
        target: Loaded,
        draft: DraftSource | Loaded | FeatureHead | LazyDraft | None = None,
        backend: str = "auto",
        feature_head: FeatureHead | None = None,
        shared: Shared | None = None,
        arithmetic: str = "fp32",
        prefix_cache_bytes: int = 0,
    ):
        """`draft`: what drafts (a `loading.DraftSource`, as `load_draft_source` gives; a draft model or a feature
        head is taken as one; a `LazyDraft` is loaded when a method first drafts with it); `feature_head`: a feature
        head beside a draft model. Each method gets the draft its declaration (`Method.drafts`) chooses: the
        feature head where it prefers one and there is one, else the draft model, else none.

        The engine owns what its runners and drafters build or learn once (`shared`: packed weights, measured
        cost curves, the feature head's calibration); another engine in the same process has its own, so two
        engines never steer each other. Pass another engine's `shared` to reuse what it built and learned.
        `prefix_cache_bytes`: the prefix cache's budget (`draftverify.prefix_cache`; 0: off; `use_prefix_cache`).
        """
        self.target = target
        self.feature_head = feature_head
        self._draft_state: tuple[DraftSource | None, Runner | None] | None = None  # resolved on first use
        self._pending_draft = draft  # what `draft` resolves (a `LazyDraft`: loaded when a method first needs it)
        if not isinstance(draft, LazyDraft):
            source = draft_source(draft)
            if source is not None and source.kind == "feature head":
                self._pending_draft, self.feature_head = None, source.feature_head
        self.backend = backend
        require(arithmetic in ARITHMETICS, f"unknown arithmetic {arithmetic!r}: use one of {', '.join(ARITHMETICS)}")
        # Cost curves measured by an earlier process on this machine, model, arithmetic and kernel build are read
        # from disk (costs.curve), so a first request does not pay for measuring them; on a model not seen here, a
        # first request times a quick one in its prefill's parts (costs.prefill), or apart (costs.curves.quick_curve).
        self.shared = (
            shared if shared is not None else Shared(packs=Packs(arithmetic), curve_folder=costs.cache_folder())
        )
        self.target_runner = Runner(target.model, backend, shared=self.shared)
        q8 = q8_linears(self.target_runner)
        require(
            self.shared.packs.arithmetic != "q8" or q8 > 0,
            "q8 arithmetic needs a target with Q4_1 / Q8_0 / GGUF block weights on the static path: use --dtype fp32",
        )
        # What autoregressive decoding here computes in, and so what every method's output is identical to.
        lower = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # a target loaded in lower precision computes in it
        self.arithmetic = "q8" if q8 > 0 else lower.get(self.target_runner.dtype, "fp32")
        self._methods: dict[tuple, Method] = {}
        self.prefix_cache = PrefixCache.resized(None, prefix_cache_bytes)
        self._targets: list[Runner] = [self.target_runner]  # per batch slot
        self._drafts: list[Runner | None] = []  # per batch slot, once the draft is resolved
        if not isinstance(self._pending_draft, LazyDraft):
            self._resolve_draft()

    def _resolve_draft(self) -> tuple[DraftSource | None, Runner | None]:
        """The draft source and its runner, loaded (a `LazyDraft`) and built on first use."""
        if self._draft_state is None:
            pending = self._pending_draft
            source = draft_source(pending.load() if isinstance(pending, LazyDraft) else pending)
            model = source.model if source is not None else None
            # A separate draft model may run on rounded weights (PackedLinear); the target drafting for itself does
            # not.
            runner = (
                Runner(model.model, self.backend, draft=model.model is not self.target.model, shared=self.shared)
                if model is not None
                else None
            )
            self._draft_state = (source, runner)
        return self._draft_state

    @property
    def draft_source(self) -> DraftSource | None:
        """What drafts beside the feature head (a draft model or the target's first layers), loaded on first use."""
        return self._resolve_draft()[0]

    @property
    def draft(self) -> Loaded | None:
        """The draft model (`draft_source`'s), loaded on first use."""
        source = self.draft_source
        return source.model if source is not None else None

    @property
    def draft_runner(self) -> Runner | None:
        """The draft model's runner on batch slot 0, built on first use."""
        return self._resolve_draft()[1]

    @property
    def draft_loaded(self) -> bool:
        """Whether the draft has been resolved (describing an engine need not load it)."""
        return self._draft_state is not None

    @classmethod
    def load(
        cls,
        target: str | None = None,
        draft: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        draft_device: str | None = None,
        device_map: str | None = None,
        backend: str = "auto",
        prefix_cache_bytes: int = 0,
    ) -> "Engine":
        """Load the target (a folder, a .gguf file or a known model's short name, e.g. "qwen2.5-coder-1.5b", fetched
        on first use: `loading.known`; default: SmolLM2-135M-Instruct) and a draft spec (see `loading.drafts`); with no
        draft spec, the default model also gets its shipped feature head (`loading.default_feature_head`).

        `backend`: `auto` (the static fast path where the architecture allows, else eager),
        `static` or `eager`; see `draftverify.models.choose_backend`. `dtype`: the weights' dtype and the target's
        arithmetic (`draftverify.arithmetic`): "q8", "fp32", "bf16", "fp16" or "auto" (its default rule).
        `prefix_cache_bytes`: the prefix cache's budget (see `__init__`; 0: off).
        """
        weights, _ = split_dtype(dtype)  # the draft's
        loaded, arithmetic = load_target(target, dtype, device, device_map, backend)
        feature_head = default_feature_head(loaded, arithmetic) if draft is None else None
        if feature_head is not None:  # its drafting copies packed now, not by the first request that drafts with it
            feature_head.pack()
        source = LazyDraft(lambda: load_draft_source(draft, loaded, dtype=weights, device=draft_device or device))
        if draft is not None:  # a draft asked for by name is loaded now: a bad spec fails at load, not mid-request
            source = source.load()
        engine = cls(loaded, source, backend=backend, feature_head=feature_head, arithmetic=arithmetic)
        engine.use_prefix_cache(prefix_cache_bytes)
        return engine

    def use_prefix_cache(self, budget: int) -> None:
        """Keep a prefix cache of `budget` bytes from now on (0: none; a budget changed keeps the entries that fit:
        a request reuses the target's keys and values of the longest prefix an earlier one computed, exactly)."""
        self.prefix_cache = PrefixCache.resized(self.prefix_cache, budget)

    def describe_drafts(self) -> str:
        """One line: the draft model and the feature head in use."""
        draft = self.draft if self.draft_loaded else None
        parts = [f"draft {draft.name}" if draft is not None else "no draft model loaded"]
        if self.feature_head is not None:
            parts.append(f"feature head {self.feature_head.name}")
        return ", ".join(parts)

    def describe_backend(self) -> str:
        """One line: the forward path each model runs on, and why `auto` fell back to eager."""
        parts = []
        for role, runner in (("target", self.target_runner), ("draft", self._draft_state and self._draft_state[1])):
            if runner is not None:
                why = f" ({runner.fallback_reason})" if runner.fallback_reason else ""
                parts.append(f"{role}: {runner.backend}{why}")
        return "; ".join(parts)

    def method(self, name: str, preset: str | None = None, slot: int = 0, **options) -> Method:
        """The method `name` configured by `preset` and `options` on batch slot `slot`, built once and reused."""
        cls = method_class(name)
        config = cls.make_config(preset, **options)
        key = (name, config, slot)
        if key not in self._methods:
            head = self.feature_head
            chosen = cls.drafts(config).choose(has_head=head is not None)  # what the method declares it drafts with
            if chosen is Artifact.FEATURE_HEAD:
                target, draft = self._target(slot), head
            elif chosen is Artifact.DRAFT_MODEL:
                target, draft = self.slot(slot)
            else:  # the draft model is not loaded for a method that would not draft with it
                target, draft = self._target(slot), None
            self._methods[key] = cls(target, draft, config, feature_head=head)
            if slot:
                self._methods[key].share(self.method(name, preset, 0, **options))
        return self._methods[key]

    def slot(self, i: int) -> tuple[Runner, Runner | None]:
        """Batch slot i's target and draft runners (made on first use; their caches are the slot's own)."""
        target, first = self._target(i), self.draft_runner
        while len(self._drafts) <= i:
            self._drafts.append(first if not self._drafts else first.fork() if first is not None else None)
        return target, self._drafts[i]

    def _target(self, i: int) -> Runner:
        """Batch slot i's target runner (made on first use)."""
        while len(self._targets) <= i:
            self._targets.append(self.target_runner.fork())
        return self._targets[i]

    def encode(
        self,
        prompt: str | list[int] | list[dict],
        chat: bool = False,
        chat_template: str | None = None,
        tools: list | None = None,
    ) -> list[int]:
        """Prompt text (raw or as one chat user turn), a chat message list, or token ids -> ids. `chat_template`:
        a Jinja template used instead of the tokenizer's own; `tools`: OpenAI function tools for a template that
        takes them (serve/tools.py)."""
        tok = self.target.tokenizer
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = list(prompt)
        elif isinstance(prompt, list) or chat:
            require(not isinstance(prompt, str) or prompt.strip(), "the prompt is empty: give some text")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            require(
                chat_template or getattr(tok, "chat_template", None),
                "this tokenizer has no chat template: drop --chat and send a raw prompt",
            )
            ids = tok.apply_chat_template(
                messages,
                chat_template=chat_template,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        else:
            require(prompt.strip() != "", "the prompt is empty: give some text")
            ids = tok(prompt)["input_ids"]
        require(len(ids) > 0, "the prompt is empty: give some text")
        context = self.target_runner.max_length
        require(
            context is None or len(ids) < context,
            f"the prompt has {len(ids)} tokens but the model's context is {context}: shorten the prompt",
        )
        return ids

    def eos_ids(self) -> tuple[int, ...]:
        """The target's stop tokens (`util.eos_ids`)."""
        return eos_ids(self.target)

    def generate(self, prompt: str | list[int] | list[dict], method: str = "auto", **settings) -> Result:
        """Generate from `prompt` with `method`; output is identical (greedy) or identically
        distributed (sampling) to what the target alone produces. `settings` are `request`'s:
        max_new_tokens, temperature, top_k, top_p, min_p, seed, eos_token_id, stop, chat, streamer,
        on_tokens, generation_config, preset, `logits.KNOBS` (presence_penalty, frequency_penalty, logit_bias,
        response_format, logprobs, top_logprobs) and the method's own options.
        """
        m, session = self.request(prompt, method, **settings)
        session.stats.start()
        try:
            m.run(session)
        finally:
            self.finish(session)
        return self.result(session)

    def generate_batch(self, prompts: list, method: str = "auto", **kwargs) -> list[Result]:
        """Generate from several prompts together (one stacked target forward per step, `batch`), each exactly
        as `generate` would alone; `kwargs` are `generate`'s (the same for every prompt; a `seed` seeds each
        request's own generator)."""
        from draftverify.batch import run_batch

        members = []
        for i, prompt in enumerate(prompts):
            m, session = self.request(prompt, method, slot=i, **kwargs)
            members.append((session, m.target, m.rounds(session)))
            session.stats.start()
        try:
            run_batch(members)
        finally:
            for session, _, _ in members:
                self.finish(session)
        return [self.result(session) for session, _, _ in members]

    def request(
        self,
        prompt: str | list[int] | list[dict],
        method: str = "auto",
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        stop: str | list[str] | None = None,
        chat: bool = False,
        streamer=None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
        generation_config=None,
        preset: str | None = None,
        slot: int = 0,
        **options,
    ) -> tuple[Method, Session]:
        """A validated request: the method instance on batch slot `slot` and the request's Session (`generate` runs
        it, a batch steps it).

        `generation_config` (a transformers GenerationConfig) overrides max_new_tokens, sampling
        and EOS settings when given. `streamer` gets the prompt and then every accepted chunk
        (a transformers TextIteratorStreamer works); `on_tokens` gets each chunk and may
        return False to cancel the request. `options` are the method's (see `draftverify methods`).
        """
        if generation_config is not None:
            gc = generation_config
            max_new_tokens = gc.max_new_tokens or max_new_tokens
            temperature = (gc.temperature if gc.temperature is not None else 1.0) if gc.do_sample else 0.0
            top_k, top_p = (gc.top_k or 0, gc.top_p or 1.0) if gc.do_sample else (0, 1.0)
            eos_token_id = gc.eos_token_id if gc.eos_token_id is not None else eos_token_id
            stop = gc.stop_strings or stop
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        ids = self.encode(prompt, chat=chat)
        if eos_token_id is None:
            eos = self.eos_ids()
        else:
            eos = tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        context = self.target_runner.max_length or 1 << 30
        require(max_new_tokens >= 1, f"max_new_tokens={max_new_tokens} must be at least 1")
        stopping = Stopping(min(max_new_tokens, context - len(ids)), eos, stops)
        processor = make_processor(options, self.target.tokenizer, eos)  # takes its knobs out of `options`
        m = self.method(method, preset, slot=slot, **options)
        session = Session(ids, sampling, stopping, self.target.tokenizer, streamer, on_tokens, processor=processor)
        session.stats.method = method
        session.prefix_cache = self.prefix_cache
        session.stats.prompt_tokens = len(ids)
        if self.target_runner.device.type == "cuda":
            session.stats.sync_device = self.target_runner.device
        if streamer is not None:
            streamer.put(torch.tensor([ids]))
        return m, session

    @staticmethod
    def finish(session: Session) -> None:
        """A request ended: its wall time, and the end of its stream."""
        session.stats.wall_s = session.stats.elapsed()
        if session.streamer is not None:
            session.streamer.end()

    @staticmethod
    def result(session: Session) -> Result:
        """What `generate` returns for an ended request."""
        logprobs = None
        if session.processor is not None and session.processor.top_logprobs is not None:
            logprobs = session.processor.logprobs[: len(session.output)]
        return Result(session.output, session.text(), session.stats, session.prompt, logprobs)
