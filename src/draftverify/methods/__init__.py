"""Decoding methods. Each module registers its method in `METHODS` by name."""

from draftverify.methods import autoregressive, lookahead, ouroboros, self_speculative, specdec_pp, speculative  # noqa: F401  (registration)
from draftverify.methods.base import METHODS, Method, register

__all__ = ["METHODS", "Method", "register"]
