"""A GGUF target's tokenizer and configs without transformers (loading/fast_tokenizer.py, chat_template.py,
plain_config.py) against transformers' own, loaded from the same cached folder: the same ids, text and chat prompts
on the default model (SmolLM2-135M) and, where it is on this machine, the real 1.5B target (Qwen2.5-Coder); the same
config and generation config attributes; and a load of a cached GGUF file that never imports transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig
from transformers.configuration_utils import PretrainedConfig
from transformers.utils.chat_template_utils import render_jinja_template

from draftverify.loading.chat_template import render
from draftverify.loading.defaults import default_model_path
from draftverify.loading.fast_tokenizer import FastTokenizer
from draftverify.loading.gguf import DIRECT_FILE, gguf_metadata, metadata_folder
from draftverify.loading.plain_config import PlainConfig, PlainGenerationConfig

QWEN = Path("/work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
FILES = [
    pytest.param(None, id="smollm2"),
    pytest.param(QWEN, id="qwen2.5", marks=pytest.mark.skipif(not QWEN.is_file(), reason="the 1.5B file is absent")),
]
TEXTS = [
    "Hello, world!",
    "",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "def f(x):\n    return x ** 2  # 平方\n",
    "café, cafe\u0301, ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ, Ångström",  # NFC matters to Qwen2's normalizer
    "emoji 🤖🧪👩‍💻 and 中文 日本語 한국어 العربية",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "<|im_start|> glued<|im_end|>text<|im_start|>",
    "numbers 1234567890 3.14159 -2e10",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime: 🤖"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, in 中文?"},
    ],
    [{"role": "user", "content": "<|im_start|>inline special<|im_end|>", "name": None}],
    [{"role": "user", "content": "Think"}, {"role": "assistant", "content": "ok", "reasoning": "hmm"}],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city <b>now</b> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": '{"temp": 3}'},
]


def both(path):
    """(ours, transformers') tokenizer of a GGUF file: ours from `gguf_metadata`, theirs from the same folder."""
    path = path or default_model_path()
    _, _, ours = gguf_metadata(path)
    assert isinstance(ours, FastTokenizer)
    return ours, AutoTokenizer.from_pretrained(metadata_folder(path), local_files_only=True)


@pytest.mark.parametrize("path", FILES)
def test_ids_and_text_are_transformers(path):
    ours, theirs = both(path)
    for text in TEXTS:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids, text
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        ids = theirs(text)["input_ids"] + [ours.eos_token_id, 5, 6]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == theirs.convert_ids_to_tokens(
                ids, skip_special_tokens=skip
            )
        assert ours.decode(ids[:1]) == theirs.decode(ids[:1]) and ours.decode(ids[0]) == theirs.decode(ids[0])
    for token in ("<|im_end|>", "Hello", "no-such-token-anywhere", ["<|im_start|>", "a"]):
        assert ours.convert_tokens_to_ids(token) == theirs.convert_tokens_to_ids(token)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token", "bos_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (len(ours), ours.vocab_size, ours.get_vocab()) == (len(theirs), theirs.vocab_size, theirs.get_vocab())
    assert (ours.all_special_ids, ours.chat_template) == (theirs.all_special_ids, theirs.chat_template)


@pytest.mark.parametrize("path", FILES)
def test_chat_prompts_are_transformers(path):
    ours, theirs = both(path)
    cases = [(chat, None) for chat in CHATS] + [(TOOL_CHAT, TOOLS), (CHATS[0], TOOLS)]
    for chat, tools in cases:
        for prompt in (True, False):
            kw = dict(tools=tools, add_generation_prompt=prompt)
            text = theirs.apply_chat_template(chat, tokenize=False, **kw)
            assert ours.apply_chat_template(chat, tokenize=False, **kw) == text
            ids = theirs.apply_chat_template(chat, tokenize=True, return_dict=True, **kw)["input_ids"]
            assert ours.apply_chat_template(chat, tokenize=True, return_dict=True, **kw)["input_ids"] == ids
            assert ours.apply_chat_template(chat, return_dict=False, **kw) == ids
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ greeting }}"
    kw = dict(chat_template=template, tokenize=False, greeting="!")
    assert ours.apply_chat_template(CHATS[1], **kw) == theirs.apply_chat_template(CHATS[1], **kw)


def test_what_the_fast_path_does_not_take_is_transformers_answer():
    """A batch of conversations, an assistant mask, an option of transformers' tokenizer: answered by transformers'
    tokenizer of the same folder, so the same result (and `.input_ids` reads an encoding as transformers' does)."""
    ours, theirs = both(None)
    batch = [CHATS[0], CHATS[1]]
    assert ours.apply_chat_template(batch, tokenize=False) == theirs.apply_chat_template(batch, tokenize=False)
    kw = dict(return_dict=True, return_assistant_tokens_mask=True)
    assert dict(ours.apply_chat_template(CHATS[1], **kw)) == dict(theirs.apply_chat_template(CHATS[1], **kw))
    assert (
        ours("a b", return_tensors="pt")["input_ids"].tolist()
        == theirs("a b", return_tensors="pt")["input_ids"].tolist()
    )
    assert ours("the the").input_ids == theirs("the the").input_ids
    assert ours.padding_side == theirs.padding_side  # an attribute only transformers' tokenizer has


TEMPLATES = [
    "{% for m in messages %}{{ m.content | tojson }}{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U:{{ m.content }}\n  {% endif %}\n{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ dict(a=1) | tojson }}",
    "{{ tools | tojson(indent=2) }}|{{ messages[-1].reasoning_content }}|{{ messages | length }}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_templates_render_as_transformers_renders_them(template):
    chat = [{"role": "user", "content": "<a> & 'b' é"}, {"role": "assistant", "content": "x", "thinking": "t"}]
    from draftverify.loading.chat_template import plain_messages

    (theirs,), _ = render_jinja_template([chat], tools=TOOLS, chat_template=template, add_generation_prompt=True)
    assert render(template, plain_messages(chat), TOOLS, True, {}) == theirs


def test_a_templates_exception_is_jinjas_template_error():
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        render("{{ raise_exception('no system') }}", [], None, False, {})


@pytest.mark.parametrize("path", FILES)
def test_configs_hold_what_transformers_holds(path):
    path = path or default_model_path()
    config, generation, _ = gguf_metadata(path)
    assert isinstance(config, PlainConfig) and isinstance(generation, PlainGenerationConfig)
    folder = metadata_folder(path)
    theirs = PretrainedConfig.from_json_file(folder / "config.json")
    names = set(vars(theirs)) - {"_post_init_done", "_attn_implementation_internal", "_experts_implementation_internal"}
    names |= {"_attn_implementation", "output_attentions", "name_or_path", "num_labels", "model_type"}
    for name in sorted(names):
        assert getattr(config, name) == getattr(theirs, name), name
    for name in ("sliding_window", "attn_logit_softcapping", "head_dim", "query_pre_attn_scalar", "hidden_activation"):
        assert hasattr(config, name) == hasattr(theirs, name), name  # what the code reads with a default
    stock = GenerationConfig.from_pretrained(folder, local_files_only=True)
    for name, value in stock.to_dict().items():
        assert getattr(generation, name) == value, name


def test_a_record_of_another_transformers_is_made_again():
    """The record a load without transformers reads names the transformers that made it; another version's is
    replaced (its tokenizer and configs could differ from this one's)."""
    path = default_model_path()
    gguf_metadata(path)
    file = metadata_folder(path) / DIRECT_FILE
    record = json.loads(file.read_text())
    file.write_text(json.dumps({**record, "transformers": "0.0.1", "config": {}}))
    config, _, _ = gguf_metadata(path)
    assert json.loads(file.read_text()) == record and config.model_type == record["config"]["model_type"]


PROBE = """
import sys
from draftverify.cli import run
sys.argv = ["draftverify", "generate", "Hi", "-n", "2", "--method", "autoregressive"]
code = run()
assert not code, code
from draftverify.engine import Engine
Engine.load().generate("Hi", max_new_tokens=2, response_format={"type": "json_object"})  # llguidance's view too
print("TRANSFORMERS", sorted(m for m in sys.modules if m.split(".")[0] == "transformers")[:3])
"""


@pytest.mark.parametrize("path", FILES)
def test_structured_outputs_view_of_the_tokenizer_is_the_one_llguidance_builds_from_transformers(path):
    from llguidance.hf import from_tokenizer

    from draftverify.constraints import _from_backend

    ours, theirs = both(path)
    mine, its = _from_backend(ours, ()), from_tokenizer(theirs)
    assert (mine.vocab_size, mine.eos_token, mine.is_canonical) == (its.vocab_size, its.eos_token, its.is_canonical)
    assert all(mine.decode_bytes([i]) == its.decode_bytes([i]) for i in range(its.vocab_size))
    assert all(mine.tokenize_str(text) == its.tokenize_str(text) for text in TEXTS)


def test_generate_on_a_cached_gguf_file_never_imports_transformers():
    gguf_metadata(default_model_path())  # the first load records what transformers built, once
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "TRANSFORMERS []"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_a_plain_config_builds_transformers_rotary_modules_alike(arch, tmp_path):
    """An architecture whose rotary module is transformers' own gets it from `transformers_config(plain)`: the same
    module, frequencies and scaling as from the config transformers read (what the record was made from)."""
    from test_gguf_archs import write_tiny
    from transformers import AutoConfig

    from draftverify.loading.gguf_model import rotary_embedding
    from draftverify.loading.plain_config import record_config

    write_tiny(tmp_path / "tiny.gguf", arch)
    AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf").save_pretrained(tmp_path)
    theirs = PretrainedConfig.from_json_file(tmp_path / "config.json")
    plain = PlainConfig(json.loads(json.dumps(record_config(theirs))))
    a, b = rotary_embedding(plain), rotary_embedding(theirs)
    assert type(a) is type(b) and getattr(a, "attention_scaling", None) == getattr(b, "attention_scaling", None)
    ours, stock = dict(a.named_buffers()), dict(b.named_buffers())
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in ours)


def test_a_tokenizer_that_cleans_up_spaces_stays_transformers():
    """transformers' decode cleans up spaces where a tokenizer asks for it (not a BPE one): no FastTokenizer stands
    for such a tokenizer, nor for one without a Rust backend; the default model's is recorded."""
    from types import SimpleNamespace

    from draftverify.loading.fast_tokenizer import tokenizer_facts

    _, theirs = both(None)
    assert tokenizer_facts(theirs)["ids"]["eos_token_id"] == theirs.eos_token_id
    theirs.clean_up_tokenization_spaces = True
    assert tokenizer_facts(theirs) is None
    assert tokenizer_facts(SimpleNamespace(is_fast=False)) is None
