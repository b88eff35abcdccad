"""Loading models: HF folders and GGUF files (`hf`, `gguf`), the default model and its shipped assets
(`defaults`), drafts and the draft-spec grammar (`drafts`), and tokenizer checks (`tokenizers`)."""

from draftverify.loading.defaults import DEFAULT_MODEL_FILE, default_model_path, shipped_draft_path
from draftverify.loading.drafts import (
    DRAFT_META_FILE,
    DraftSource,
    decoder_layers,
    default_feature_head,
    draft_source,
    layer_prefix,
    load_draft,
    load_draft_source,
    truncated_copy,
)
from draftverify.loading.hf import DTYPES, Loaded, load_model, model_device, model_identity, stock_model, vocab_rows
from draftverify.loading.tokenizers import check_same_tokenizer, tokenizer_fingerprint

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DRAFT_META_FILE",
    "DTYPES",
    "DraftSource",
    "Loaded",
    "check_same_tokenizer",
    "decoder_layers",
    "default_feature_head",
    "default_model_path",
    "draft_source",
    "layer_prefix",
    "load_draft",
    "load_draft_source",
    "load_model",
    "model_device",
    "model_identity",
    "shipped_draft_path",
    "stock_model",
    "tokenizer_fingerprint",
    "truncated_copy",
    "vocab_rows",
]
