"""The feature head's own KV cache for one request (`HeadCache`), which implements the `backend.KVCache`
protocol (length / crop / select / fork / reset) like the target's caches, and the head's drafting forward."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from draftverify.backend.decoder import ATTENTION_HEAD_DIMS
from draftverify.backend.linear import QUANT_ROWS, layer_weights
from draftverify.backend.ops import cpu_kernels, rms_norm
from draftverify.feature_head import FeatureHead


class HeadCache:
    """The head's own KV cache for one request: committed positions, then scratch draft entries."""

    def __init__(self, head: FeatureHead, capacity: int = 256):
        c = head.config
        self.head, self.length = head, 0
        shape = (1, c.num_kv_heads, capacity, c.head_dim)
        self.keys = torch.zeros(shape, dtype=head.fc.weight.dtype, device=head.fc.weight.device)
        self.values = torch.zeros_like(self.keys)
        self.causal = torch.ones(
            capacity, capacity, dtype=torch.bool, device=self.keys.device
        ).tril()  # row past + i: a new row's mask, no tree
        fast = head._fast is not None and self.keys.dtype == torch.float32 and c.head_dim in ATTENTION_HEAD_DIMS
        kernels = cpu_kernels() if fast else None
        self.rope_attention = kernels.rope_attention if kernels is not None else None
        self.layer = kernels.layer if kernels is not None else None
        # the rounded copies (Q8_0, in the q8 tiles with VNNI, `pack`): the one-call layer takes them
        self.fused = (
            layer_weights(*(head._fast[name] for name in ("qkv", "o", "gate_up", "down")))
            if kernels is not None
            else None
        )
        self.no_mask = torch.empty(0, dtype=torch.bool)
        # what every drafting forward passes, read once (a module's attributes cost a lookup each, run cache-cold)
        self.norms = (head.norm_in.weight, head.norm_post.weight, c.rms_eps)
        self.norm_out = (head.norm_out.weight, head.norm_out.eps)
        self.scale = c.head_dim**-0.5

    def _reserve(self, n: int) -> None:
        if n > self.keys.shape[2]:
            grow = max(n, 2 * self.keys.shape[2])
            pad = (0, 0, 0, grow - self.keys.shape[2])
            self.keys, self.values = F.pad(self.keys, pad), F.pad(self.values, pad)
            self.causal = torch.ones(grow, grow, dtype=torch.bool, device=self.keys.device).tril()

    @torch.inference_mode()
    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append n rows (features [n, H], next tokens [n], positions [n]: a tensor or ints); return the predicted
        features [n, H].

        mask: bool [n, S] over the last S entries including the new rows (True = may attend); every
        earlier entry is attended. None: causal among the new rows.
        """
        head, past, n = self.head, self.length, tokens.shape[0]
        self._reserve(past + n)
        full = None
        if mask is not None:
            full = torch.cat(
                [torch.ones(n, past + n - mask.shape[1], dtype=torch.bool, device=mask.device), mask], dim=1
            )
        elif n > 1:
            full = self.causal[past : past + n, : past + n].contiguous()
        self.length = past + n
        x = head.inputs(features, tokens)  # [n, H]
        if self.rope_attention is not None and not head.training and n <= QUANT_ROWS:
            # drafting: the target's fused kernel (rotate q and k, store k and v, attend), as its static path does
            cos, sin = head.rope_rows(positions)
            mask, scale = self.no_mask if full is None else full, self.scale
            if self.fused is not None:  # the whole layer in one call, as the target's static path runs its own
                x = self.layer(
                    x,
                    *self.norms,
                    *self.fused,
                    cos,
                    sin,
                    self.keys[0],
                    self.values[0],
                    past,
                    head.config.num_heads,
                    mask,
                    scale,
                )
                return rms_norm(x, *self.norm_out)  # `_norm`'s drafting path
            qkv = head._linear("qkv", head._norm("norm_in", x))
            out = self.rope_attention(
                qkv, cos, sin, self.keys[0], self.values[0], past, head.config.num_heads, mask, scale
            )
            return head.after_attention(x, out)
        x = x.unsqueeze(0)  # [1, n, H]
        q, k, v = head.qkv(x, torch.as_tensor(positions, device=x.device).view(1, n))
        self.keys[:, :, past : past + n], self.values[:, :, past : past + n] = k, v
        return head.finish(x, q, self.keys[:, :, : past + n], self.values[:, :, : past + n], full)[0]

    # -- the KVCache protocol (backend/cache.py) ----------------------------------------------------

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def select(self, keep: int, slots: list[int]) -> None:
        if slots == list(range(keep, keep + len(slots))):
            return self.crop(keep + len(slots))
        index = torch.tensor(slots, device=self.keys.device)
        for buf in (self.keys, self.values):  # [1, kv heads, capacity, d]: the accepted slots move down to keep..
            buf[:, :, keep : keep + len(slots)] = buf.index_select(2, index)
        self.length = keep + len(slots)

    def fork(self) -> "HeadCache":
        return HeadCache(self.head, capacity=self.keys.shape[2])

    def reset(self) -> None:
        self.length = 0
