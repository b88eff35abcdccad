"""Batch stacking: the rows of several sequences in one forward, each on the product its own forward would use."""

from __future__ import annotations

import torch

from draftverify.backend.linear import QUANT_ROWS, PackedLinear


class Spans:
    """The rows of a stacked forward, (first row, count) per sequence in order, and how a linear takes them:
    each sequence's rows on the product its own forward would use, so stacking changes no row's arithmetic.
    The quantized product is row-invariant and takes every short sequence's rows in one call; oneDNN, whose
    sums may depend on the row count, takes each long sequence's rows (a prefill) alone. A file's block product
    (`BlockLinear.any_rows`) is the same product at every row count and takes all rows in one call."""

    def __init__(self, spans: list[tuple[int, int]], device):
        self.single = len(spans) == 1
        self.long = [(a, n) for a, n in spans if n > QUANT_ROWS]
        short = [(a, n) for a, n in spans if n <= QUANT_ROWS]
        self.short = (
            None
            if self.single or not short or not self.long
            else torch.cat([torch.arange(a, a + n, device=device) for a, n in short])
        )

    def __call__(self, linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.single or linear.blocks is None or linear.any_rows:  # one sequence; one product for any rows
            return linear(x)
        if not self.long:
            return linear(x, quant=True)
        out = x.new_empty(x.shape[0], linear.out_features)
        if self.short is not None:
            out[self.short] = linear(x[self.short], quant=True)
        for a, n in self.long:
            out[a : a + n] = linear(x[a : a + n])
        return out
