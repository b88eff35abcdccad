"""The target answers a batch of prompts: one left-padded `model.generate`, each reply cut after its first EOS.

The offline tools' path for it (the feature head's training data, the acceptance head's answers, a draft model's
template-prompt data; a draft model's --prompts data is decoded on the engine instead, `make_draft.data`). A
batch's step reads the weights once for all its rows, so this is much faster than answering one prompt at a time;
left padding moves the stock model's arithmetic slightly, which training data does not mind. Decoding that must
equal plain decoding runs on the engine instead (`batch.run_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.loading import Loaded
from draftverify.util import eos_ids

SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # how the tools' sampled training replies are drawn


@dataclass
class Replies:
    """`model.generate`'s output for a left-padded batch, and each prompt's reply."""

    out: object  # the GenerateOutput: sequences [B, width + G], and the logits / hidden states asked for
    width: int  # the padded prompts' length: out.sequences[:, width:] are the new tokens
    replies: list[list[int]]  # per prompt, its new tokens up to and including its first EOS


def left_padded(target: Loaded, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
    """`prompts` as one left-padded batch for `generate`: ids [B, P], attention mask [B, P], the pad id and the
    target's EOS ids."""
    eos = list(eos_ids(target))
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    return ids, mask, pad, eos


@torch.inference_mode()
def answer(
    target: Loaded, prompts: list[list[int]], max_new_tokens: int, sample: dict | None = None, **outputs
) -> Replies:
    """The target's replies to `prompts` in one batched `generate`: greedy, or sampled with `sample`'s settings
    (temperature, top_p, top_k; from the global torch generator). `outputs`: GenerationConfig flags such as
    output_logits=True or output_hidden_states=True."""
    from transformers import GenerationConfig

    ids, mask, pad, eos = left_padded(target, prompts)  # [B, P]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample is not None,
        **{"temperature": None, "top_p": None, "top_k": None, **(sample or {})},
        pad_token_id=pad,
        eos_token_id=eos,
        return_dict_in_generate=True,
        **outputs,
    )
    device = target.device
    out = target.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    width = ids.shape[1]
    return Replies(out, width, [cut_after_eos(row, eos) for row in out.sequences[:, width:].tolist()])


def cut_after_eos(tokens: list[int], eos: list[int] | tuple[int, ...]) -> list[int]:
    """`tokens` up to and including the first EOS (all of them when there is none)."""
    return tokens[: next((n + 1 for n, token in enumerate(tokens) if token in eos), len(tokens))]
