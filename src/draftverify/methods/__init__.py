"""Decoding methods. Each module registers its method in `METHODS` by name."""

from draftverify.drafters.base import STANDALONE
from draftverify.methods import auto, autoregressive, lookahead, ouroboros, self_speculative, specdec_pp, speculative  # noqa: F401  (registration)
from draftverify.methods.base import METHODS, Method, register, standalone_method

for _name, (_drafter, _config, _presets) in STANDALONE.items():
    register(standalone_method(_name, _drafter, _config, _presets))

__all__ = ["METHODS", "Method", "register"]
