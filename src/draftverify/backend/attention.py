"""Attention of the static decoder, per sequence against its own cache: which kernel runs for which call.

Every path masks with the same boolean [n, past + n] mask (`ops.window_masks`; None = attend every key)
and writes the new keys and values at slots past..past+n-1 of the sequence's cache:

1. no per-head q/k norm: one kernel call rotates q and k, stores k and v, attends (kernels/csrc/attention.cpp
   `rope_attention`), for a prefill `PREFILL_ROWS` rows a call, one call after another (a call's partial sums grow
   with its rows times their key chunks; docs/backends.md compares the chunk sizes and SDPA);
2. few new tokens otherwise (Qwen3's normed q and k): rotate here, then the attention kernel;
3. a prefill otherwise: the same, the attention kernel over `PREFILL_ROWS` query rows a call;
4. without the kernels: one query over every key as three small ops, else SDPA with the mask;
5. soft-capped scores (Gemma 2), which no kernel caps: `capped`, batched products in Python.
Each token's row is computed alone on the kernel paths and, for few new tokens, in `capped`, so a row's bits do
not depend on the others. A q8 target's cache is fp16 (`StaticDecoder.kv_dtype`): the kernels store each key and
value rounded and read them upcast, the Python paths store through torch's rounding copy and read an upcast copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftverify.backend.cache import StaticCache
from draftverify.backend.linear import QUANT_ROWS
from draftverify.backend.ops import rms_norm, rotate_half

PREFILL_ROWS = 128  # a prefill's query rows per call of the attention kernel


@dataclass
class Part:
    """One sequence's share of a (stacked) forward: its cache, its rows first..first+n-1 of the stack, the
    cache length before it, and its masks by window (None = attend every key)."""

    cache: StaticCache
    first: int
    n: int
    past: int
    masks: dict


def attend(dec, i: int, layer, qkv: torch.Tensor, cos, sin, part: Part) -> torch.Tensor:
    """Layer i's attention for one sequence: qkv [n, q + k + v] of its rows, cos / sin [n, 1, d] -> [n, heads * d]."""
    mask, past, n = part.masks[dec.windows[i]], part.past, part.n
    keys, values = part.cache.keys[i], part.cache.values[i]
    no_mask = dec.no_mask if mask is None else mask
    if dec.rope_attention is not None and layer.q_norm is None and layer.softcap is None:  # 1.
        if n <= QUANT_ROWS:
            return dec.rope_attention(
                qkv, cos[:, 0], sin[:, 0], keys, values, past, dec.n_heads, no_mask, layer.scaling
            )
        return by_prefill_rows(
            n,  # each call stores its keys first and attends the cache's so far (the mask hides later ones)
            lambda r, e: dec.rope_attention(
                qkv[r:e], cos[r:e, 0], sin[r:e, 0], keys, values, past + r, dec.n_heads,
                mask[r:e, : past + e].contiguous(), layer.scaling,
            ),
        )  # fmt: skip
    q, k, v = rotated(dec, layer, qkv, cos, sin)
    keys[:, past : past + n] = k.transpose(0, 1)
    values[:, past : past + n] = v.transpose(0, 1)
    if layer.softcap is not None:  # 5.
        return capped(dec, layer, q, keys[:, : past + n].to(q.dtype), values[:, : past + n].to(q.dtype), mask)
    if dec.attention_kernel is not None and n <= QUANT_ROWS:  # 2.
        return dec.attention_kernel(q, keys, values, past + n, no_mask, layer.scaling)
    if dec.attention_kernel is not None:  # 3. (n > 1, so a mask)
        return by_prefill_rows(
            n, lambda r, e: dec.attention_kernel(q[r:e], keys, values, past + n, mask[r:e], layer.scaling)
        )
    if n == 1 and mask is None:  # 4. one query, every key: three small ops beat SDPA's CPU kernel
        groups = q[0].view(dec.n_kv, dec.n_heads // dec.n_kv, dec.head_dim)  # query head h reads kv head h // group
        scores = torch.bmm(groups, keys[:, : past + 1].transpose(1, 2)).mul_(layer.scaling)
        out = torch.bmm(scores.softmax(-1, dtype=torch.float32).to(q.dtype), values[:, : past + 1])
        return out.view(1, dec.n_heads * dec.head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, heads, n, d]
        keys[:, : past + n].unsqueeze(0),  # [1, kv heads, past + n, d]
        values[:, : past + n].unsqueeze(0),
        attn_mask=mask,
        scale=layer.scaling,
        enable_gqa=dec.n_heads != dec.n_kv,
    )  # [1, heads, n, d]
    return out[0].transpose(0, 1).reshape(n, dec.n_heads * dec.head_dim)


def by_prefill_rows(n: int, call) -> torch.Tensor:
    """A prefill's attention `PREFILL_ROWS` query rows a call, one call after another: `call(first, end)` gives rows
    first..end-1 (a call's partial sums grow with its rows times their key chunks)."""
    return torch.cat([call(r, min(r + PREFILL_ROWS, n)) for r in range(0, n, PREFILL_ROWS)])


def capped(dec, layer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """Soft-capped attention (Gemma 2), as transformers' eager attention computes it: s = q k^T * scaling, then
    cap * tanh(s / cap), then the mask and an fp32 softmax. q [n, heads, d]; keys, values [kv heads, S, d] (the
    slots in use); mask [n, S] bool or None. Few new tokens go one row a product (a row's sums then do not depend
    on the rows beside it); a prefill `PREFILL_ROWS` rows a product. -> [n, heads * d]."""
    n, (kv, length, d) = q.shape[0], keys.shape
    group = dec.n_heads // kv  # query head h reads kv head h // group
    step = 1 if n <= QUANT_ROWS else PREFILL_ROWS
    keys_t = keys.transpose(1, 2)  # [kv, d, S]
    outs = []
    for r in range(0, n, step):
        m = min(step, n - r)
        qg = q[r : r + m].reshape(m, kv, group, d).transpose(0, 1).reshape(kv, m * group, d)
        scores = torch.tanh(torch.bmm(qg, keys_t).mul_(layer.scaling).div_(layer.softcap)).mul_(layer.softcap)
        if mask is not None:  # [kv, m * group, S]: row i's heads share mask row r + i
            hidden = ~mask[r : r + m].view(1, m, 1, length)
            scores = scores.view(kv, m, group, length).masked_fill(hidden, float("-inf")).view(kv, m * group, length)
        out = torch.bmm(scores.softmax(-1, dtype=torch.float32).to(q.dtype), values)  # [kv, m * group, d]
        outs.append(out.view(kv, m, group, d).transpose(0, 1).reshape(m, dec.n_heads * d))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def rotated(dec, layer, qkv, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's rows of the fused projection [n, q + k + v] -> q [n, heads, d], k and v [n, kv heads, d],
    q and k rotated."""
    d, n = dec.head_dim, qkv.shape[0]
    v = qkv[:, layer.q_size + layer.kv_size :].view(n, dec.n_kv, d)
    if layer.q_norm is None:  # rotate q and k together: [n, heads + kv heads, d]
        qk = qkv[:, : layer.q_size + layer.kv_size].view(n, dec.n_heads + dec.n_kv, d)
        qk = qk * cos + rotate_half(qk) * sin
        return qk[:, : dec.n_heads], qk[:, dec.n_heads :], v
    q = rms_norm(qkv[:, : layer.q_size].view(n, dec.n_heads, d), *layer.q_norm)  # Qwen3: per-head norms first
    k = rms_norm(qkv[:, layer.q_size : layer.q_size + layer.kv_size].view(n, dec.n_kv, d), *layer.k_norm)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v
