"""Autoregressive decoding: one target forward per token, our own KV-cached loop.

The baseline every speedup is measured against: the shared round with no drafter (prefill the
prompt; then pick a token, argmax or a sample after temperature/top-k/top-p, emit it, feed it).
"""

from __future__ import annotations

from draftverify.methods.base import Method, register


@register
class Autoregressive(Method):
    name = "autoregressive"
