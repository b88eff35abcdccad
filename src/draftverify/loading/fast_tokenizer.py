"""`FastTokenizer`: a GGUF target's tokenizer on the `tokenizers` library alone, without importing transformers.

It holds the Rust tokenizer exactly as transformers built it (its JSON, saved once by `loading.gguf`, after the
tokenizer class's own changes, e.g. Qwen2's NFC normalizer) and the facts transformers derived (special tokens and
their ids, the chat template, the sizes), and answers what this project asks of a transformers tokenizer:
`tok(text)["input_ids"]`, `encode`, `decode`, `convert_ids_to_tokens` / `convert_tokens_to_ids`, `get_vocab`, `len`,
the special token ids and `apply_chat_template` (`chat_template.render`, transformers' Jinja environment). Each is
transformers' own steps over the same Rust tokenizer, so the same ids and text (tests/test_fast_tokenizer.py
compares them on the default model and the real target). Anything else (an option these do not take, another
attribute) is answered by the transformers tokenizer of the same folder, built on first such use (`transformers()`).
Adding tokens is not supported here: the two would then differ.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from draftverify.loading.chat_template import is_plain, plain_messages, render

# What `__call__` / `encode` / `decode` take themselves; any other option goes to the transformers tokenizer.
_ENCODE = {"add_special_tokens"}
_DECODE = {"skip_special_tokens", "clean_up_tokenization_spaces"}
# apply_chat_template's options with the defaults under which it is answered here
_CHAT_DEFAULTS = {
    "documents": None,
    "continue_final_message": False,
    "sanitize_control_tokens": False,
    "padding": False,
    "truncation": False,
    "max_length": None,
    "return_tensors": None,
    "return_assistant_tokens_mask": False,
    "tokenizer_kwargs": None,
}


class FastTokenizer:
    """See the module docstring. `backend`: the Rust tokenizer; `facts`: what `tokenizer_facts` recorded; `folder`:
    the cached folder the transformers tokenizer loads from when something needs it."""

    is_fast = True

    def __init__(self, backend: tokenizers.Tokenizer, facts: dict, folder: Path):
        self._tokenizer = backend  # transformers' name for it (`backend_tokenizer`)
        self._folder = Path(folder)
        self._hf = None
        self.special_tokens_map = dict(facts["special_tokens_map"])
        for name in ("bos", "eos", "unk", "pad"):
            setattr(self, f"{name}_token", facts["special_tokens_map"].get(f"{name}_token"))
            setattr(self, f"{name}_token_id", facts["ids"].get(f"{name}_token_id"))
        self.all_special_tokens = list(facts["all_special_tokens"])
        self.all_special_ids = list(facts["all_special_ids"])
        self.chat_template = facts["chat_template"]
        self.model_max_length = facts["model_max_length"]
        self.name_or_path = str(self._folder)

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text, add_special_tokens: bool = True, **options):
        if options or not isinstance(text, str):
            return self.transformers()(text, add_special_tokens=add_special_tokens, **options)
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids))

    def encode(self, text, add_special_tokens: bool = True, **options) -> list[int]:
        if options or not isinstance(text, str):
            return self.transformers().encode(text, add_special_tokens=add_special_tokens, **options)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **options) -> str:
        """The text of `token_ids` (an id or a list of ids), as transformers decodes it: the Rust decode, and no
        clean-up of spaces (`tokenizer_facts` builds no FastTokenizer for a tokenizer that asks for one)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if set(options) - _DECODE or options.get("clean_up_tokenization_spaces") or not _ids(token_ids):
            return self.transformers().decode(token_ids, skip_special_tokens=skip_special_tokens, **options)
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **options) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **options) for s in sequences]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs,
    ):
        """transformers' `apply_chat_template` for one conversation of plain messages (dicts of JSON values) with
        tools given as JSON schemas: the template rendered as transformers renders it (`chat_template.render`) and
        the text encoded without special tokens. Other inputs (a batch, message objects, callables as tools,
        documents, continuing the last message, masks, padding, tensors) go to the transformers tokenizer."""
        messages = plain_messages(conversation)
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _CHAT_DEFAULTS}
        plain = is_plain(kwargs) and (tools is None or (is_plain(tools) and all(type(t) is dict for t in tools)))
        if messages is None or not plain or any(_CHAT_DEFAULTS[k] != v for k, v in options.items()):
            return self.transformers().apply_chat_template(
                conversation,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=return_dict,
                **options,
                **kwargs,
            )
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = self._template(chat_template, tools)
        text = render(template, messages, tools, add_generation_prompt, {**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    def _template(self, chat_template: str | None, tools) -> str:
        """transformers' `get_chat_template`: the argument (a template or, with several, a name), else the default."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                return self.transformers().get_chat_template(chat_template, tools)  # its error
            return chat_template
        if chat_template is None:
            if own is None:
                return self.transformers().get_chat_template(chat_template, tools)  # its error
            return own
        return chat_template

    def transformers(self):
        """The transformers tokenizer of the same folder (built once): for what this class does not answer."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self._folder, local_files_only=True)
        return self._hf

    def __getattr__(self, name: str):
        if name.startswith("_"):  # private names (and pickling's probes) are never the transformers tokenizer's
            raise AttributeError(name)
        return getattr(self.transformers(), name)


class Encoding(dict):
    """An encoding's fields by key or attribute (`enc["input_ids"]`, `enc.input_ids`), as transformers'
    `BatchEncoding` gives them for one text."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _ids(token_ids) -> bool:
    """Is `token_ids` a list or tuple of Python ints (what the Rust decode takes as transformers passes it)?"""
    return isinstance(token_ids, (list, tuple)) and all(type(i) is int for i in token_ids)


def tokenizer_facts(tokenizer) -> dict | None:
    """What a `FastTokenizer` needs of a transformers tokenizer besides its Rust tokenizer, or None when one would not
    behave the same: a tokenizer without a Rust backend, or one that cleans up spaces when decoding."""
    if not getattr(tokenizer, "is_fast", False) or tokenizer.clean_up_tokenization_spaces:
        return None
    names = ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id")
    return {
        "special_tokens_map": dict(tokenizer.special_tokens_map),
        "ids": {name: getattr(tokenizer, name) for name in names},
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "all_special_ids": list(tokenizer.all_special_ids),
        "chat_template": tokenizer.chat_template,
        "model_max_length": tokenizer.model_max_length,
    }
