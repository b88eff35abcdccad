"""The backend seam: how a model runs token by token against a KV cache.

- `feed`: `Feed` (what one forward is asked) and `Forward` (what it returns), shared by every path;
- `cache`: the `KVCache` protocol (length / crop / select / fork / reset) and its model caches;
- `eager`: the stock transformers model over a `DynamicCache`, for any causal LM;
- `decoder`: the static fast path (`StaticDecoder`), built from
  `recipe` (an architecture as data, and the support checks), `linear` (prepacked and quantized
  products, `Packs`), `attention` (the kernel dispatch), `spans` (batch stacking) and `ops`.
`models.Runner` is the one object above them that the round, the step and the drafters see.
"""

from draftverify.backend.cache import EagerCache, KVCache, StaticCache
from draftverify.backend.feed import Feed, Forward

__all__ = ["EagerCache", "Feed", "Forward", "KVCache", "StaticCache"]
