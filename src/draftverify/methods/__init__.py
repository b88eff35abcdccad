"""Decoding methods. Each module registers its method in `METHODS` by name."""

from draftverify.methods import autoregressive, speculative  # noqa: F401  (registration)
from draftverify.methods.base import METHODS, Method, register

__all__ = ["METHODS", "Method", "register"]
