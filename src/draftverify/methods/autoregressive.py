"""Autoregressive decoding: one target forward per token, our own KV-cached loop.

The baseline every speedup is measured against. Steps: prefill the prompt; then pick a
token (argmax, or a sample after temperature/top-k/top-p), emit it, feed it, repeat.
"""

from __future__ import annotations

from draftverify.methods.base import Method, register
from draftverify.session import Session


@register
class Autoregressive(Method):
    name = "autoregressive"

    def run(self, s: Session) -> None:
        logits = self.prefill(s)
        while True:
            token = self.pick(logits, s, self.target.device)
            s.stats.steps.append(1)
            if not s.emit([token]):
                return
            with s.stats.timer("verify"):
                logits = self.target.forward([token]).logits[-1]
            s.stats.target_forwards += 1
