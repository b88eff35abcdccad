"""The static path's products: stock linears fused and prepacked once, and the choice of product per call.

A `PackedLinear` is y = x W^T + b for one or more stock linears fused along the output dimension. Which
product runs depends on the weight and the row count, never on anything else, so a row's arithmetic is
the same whichever forward carries it:

- a weight that is exactly Q4_1 / Q8_0 blocks (a GGUF model, loaded as the blocks dequantized to fp32)
  keeps those blocks, and forwards over at most `QUANT_ROWS` rows multiply with them
  (kernels/quant.py): the same fp32 weights rebuilt in registers, each row's sums formed the same way
  for any row count, so a verified token's logits are bit for bit those of a one-token step;
- one row of a plain fp32 weight goes to our one-row kernel (kernels/csrc/products_fp32.cpp) where it is built;
- anything else goes to oneDNN's prepacked product (`torch.ops.mkldnn._linear_pointwise`, what inductor
  emits for a frozen fp32 linear), or to `F.linear` where oneDNN cannot take the weight.

A `BlockLinear` is the same for weights read straight from a GGUF file (`kernels.blocks.PackedWeight`, every
layout: Q4_0..Q6_K, F16, BF16, F32): `PRODUCTS` is the one table saying which product each layout gets for
which row counts; a product may serve only some row counts only if each of its rows is bit for bit the
one-row product of that row (`block_linear` is: its sums are formed alike for any row count), so a row's
arithmetic never depends on the forward that carries it.

docs/backends.md has the measured cost of each product and why the thresholds sit where they do.
`Packs` shares one PackedLinear between every decoder of the same weights (forks, a truncated draft of
the target); an engine owns one.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from draftverify.backend.ops import cpu_kernels

_PACK_ROWS = 32  # oneDNN packing hint: one packing serves every row count we use (docs/backends.md)
QUANT_ROWS = 32  # up to this many rows, exactly quantized weights take the quantized product (docs/backends.md)


class Packs:
    """The PackedLinears made so far, keyed by the weights they read, so that decoders of the same weights share
    them. A live PackedLinear belongs to a decoder that holds its model, so the weights' addresses in a key
    cannot be reused while the entry exists. Owned by whoever shares it (an `Engine`); no process-wide copy."""

    def __init__(self, arithmetic: str = "fp32"):
        self._packed: weakref.WeakValueDictionary[tuple, PackedLinear] = weakref.WeakValueDictionary()
        self.arithmetic = arithmetic  # the target's ("fp32" or "q8"; a draft's linears ignore it)

    def linear(self, linears: list[torch.nn.Linear], draft: bool = False) -> "PackedLinear":
        """The PackedLinear of these stock linears (`draft`: see PackedLinear), made on first use."""
        key = (draft, *((w.data_ptr(), tuple(w.shape), w.dtype, str(w.device)) for w in (x.weight for x in linears)))
        found = self._packed.get(key)
        if found is None:
            found = self._packed[key] = PackedLinear(linears, draft, self.arithmetic)
        return found


class PackedLinear:
    """y = x W^T + b for several stock linears fused along the output dimension, prepacked on CPU.

    `draft`: a draft's weight gets a rounded copy (`quant_blocks`): Q8_0 blocks, multiplied in the q8 arithmetic's
    tiles at any row count where the CPU has AVX-512 VNNI, else by the Q8_0 product for few-row forwards: a
    draft's precision changes what it proposes, never what verification accepts.

    `arithmetic` "q8": a target weight with exact Q4_1 / Q8_0 blocks takes the q8 product (kernels/q8.py) at every
    row count. A q8 weight's `quant` is what the one-call layer takes of it (`q8_layer_weight`)."""

    any_rows = False  # one product for every row count (`BlockLinear`): no, oneDNN's sums may depend on it

    def __init__(self, linears: list[torch.nn.Linear], draft: bool = False, arithmetic: str = "fp32"):
        weights = [lin.weight.detach() for lin in linears]
        weight = weights[0].contiguous() if len(weights) == 1 else torch.cat(weights)  # [out, in] (one: not copied)
        self.bias = _fused_bias(linears, weight)
        self.out_features = weight.shape[0]
        self.blocks = quant_blocks(weight, draft)  # exact Q4_1 / Q8_0 blocks (or a draft's rounding), or None
        self._no_bias = torch.empty(0, dtype=weight.dtype, device=weight.device)
        vnni = self.blocks is not None and cpu_kernels().vnni()  # the q8 tiles on AVX-512 VNNI
        self.q8 = q8_weight(self.blocks) if (arithmetic == "q8" and not draft) or (draft and vnni) else None
        # q8 takes every row count (`__call__`): no fp32 copy of the weight is ever multiplied, none is kept.
        self.packed = packable(weight) and self.q8 is None
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS) if self.packed else weight
        if self.q8 is not None:
            self.weight = None
        b = self.blocks  # the quantized product's arguments, as `quant_linear` and the one-call `layer` take them
        if self.q8 is not None:
            self.quant = q8_layer_weight(self.q8, self.bias)
        else:
            self.quant = None if b is None else [b.q, b.d, b.m, self.bias if self.bias is not None else self._no_bias]
        # A weight with blocks takes the quantized product for one row, so it keeps no second plain copy.
        self.kernel = one_row_kernel(weight) if self.blocks is None else None
        self.dense = weight.contiguous() if self.kernel is not None else None

    def __call__(self, x: torch.Tensor, quant: bool = False) -> torch.Tensor:  # [m, in] -> [m, out]
        """`quant`: the quantized product (if the weight has blocks) whatever the number of rows (a q8 weight takes
        its product at any row count)."""
        if self.q8 is not None:
            return q8_product(self.q8, x, self.bias)
        if self.quant is not None and (quant or x.shape[0] <= QUANT_ROWS):
            return cpu_kernels().quant_linear(x.contiguous(), *self.quant)
        if self.kernel is not None and x.shape[0] == 1:
            return self.kernel.linear(x.contiguous(), self.dense, self.bias if self.bias is not None else self._no_bias)
        if self.packed:
            if x.shape[0] == 2:  # oneDNN's AVX2 kernel is slower for 2 rows than for 3: pad (docs/backends.md)
                return self._onednn(torch.cat([x, x[1:]]))[:2]
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _fused_bias(linears: list[torch.nn.Linear], weight: torch.Tensor) -> torch.Tensor | None:
    """The fused linears' biases end to end (zeros for one without), or None when none has a bias."""
    if all(lin.bias is None for lin in linears):
        return None
    zeros = [torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device) for lin in linears]
    return torch.cat([lin.bias.detach() if lin.bias is not None else z for lin, z in zip(linears, zeros)])


def quant_blocks(weight: torch.Tensor, draft: bool = False):
    """The exact Q4_1 / Q8_0 blocks of `weight` when the compiled kernels can multiply them (else None); for a
    draft, its Q8_0 rounding."""
    kernels = cpu_kernels()
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or kernels is None:
        return None
    from draftverify.kernels.quant import exact_blocks, q8_blocks

    return q8_blocks(weight) if draft else exact_blocks(weight)


def one_row_kernel(weight: torch.Tensor):
    """The compiled kernels if their one-row product serves this weight: fp32 on a CPU, in-features a
    multiple of 32 (docs/backends.md compares it with oneDNN's one-row product)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[1] % 32:
        return None
    return cpu_kernels()


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can prepack this weight: fp32 wherever it runs; bf16 only where the CPU has oneDNN's bf16
    path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither and its reorder raises)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


# Layout of a PackedWeight -> (product, the row counts it serves). `block_linear` is row-invariant at every row
# count, and a file's weight keeps no fp32 copy for another product, so every layout takes it throughout. A
# product that is row-invariant only up to some row count would enter here with that range.
PRODUCTS: dict[str, tuple[str, range]] = {
    layout: ("blocks", range(1, 1 << 62)) for layout in ("u4", "u8", "f16", "bf16", "f32")
}


# The q8 arithmetic (kernels/q8.py): code layouts take the int8-activation product, row-invariant at every row count;
# F16 / BF16 / F32 weights have no codes and keep the block product (q8 applies to block weights only).
PRODUCTS_Q8: dict[str, tuple[str, range]] = {
    **PRODUCTS,
    "u4": ("q8", range(1, 1 << 62)),
    "u8": ("q8", range(1, 1 << 62)),
    "u5": ("q8", range(1, 1 << 62)),  # the q8 tiles of u8 codes below 32 (`kernels.q8.prepare`)
    "u6": ("q8", range(1, 1 << 62)),  # and of u8 codes below 64
}
PRODUCT_TABLES = {"fp32": PRODUCTS, "q8": PRODUCTS_Q8}  # arithmetic -> its table (`arithmetic.ARITHMETICS`)


def product(weight, m: int, arithmetic: str = "fp32") -> str:
    """The product `weight` (a PackedWeight) gets for a forward of `m` rows in `arithmetic`: the first row of its
    table (`PRODUCT_TABLES`) for its layout whose range holds m."""
    name, rows = PRODUCT_TABLES[arithmetic][weight.layout]
    if m not in rows:
        raise ValueError(f"no product for {weight.layout} weights at {m} rows: extend backend.linear.PRODUCTS")
    return name


class BlockLinear:
    """y = x W^T + b for PackedWeights fused along the output dimension (q|k|v, gate|up, a tied head), multiplied
    in the file's own blocks. Consecutive parts of one layout are concatenated into one weight (one call); a fused
    product of mixed layouts (Q4_K_M's q, k in Q4_K and v in Q6_K) runs one call per run of parts. Each output
    element is one part's row dotted with x, so fusing changes no bits. Quacks as PackedLinear where the decoder
    and `Spans` ask: `blocks` (row-invariant: stacked rows share one call), `quant` (the weight as the kernels'
    one-call `layer` takes it, `layer_weight`), `out_features`."""

    any_rows = True  # one product for every row count: the rows of any sequences may share a call (`Spans`)

    def __init__(self, weights: list, bias: torch.Tensor | None = None, arithmetic: str = "fp32"):
        self.parts = [for_arithmetic(w, arithmetic) for w in concat_runs(weights)]
        self.arithmetic = arithmetic  # "fp32" or "q8" (`PRODUCT_TABLES`)
        self.bias = bias
        self.out_features = sum(w.shape[0] for w in self.parts)
        self.blocks = self  # row-invariant at every row count (`Spans` may stack any rows into one call)
        self.quant = self.layer_weight()

    def layer_weight(self) -> list | None:
        """The parts as csrc/layer.cpp's `dv::quant_product` takes a file's weight: per part {spec, codes, d, m}
        (spec: its product, layout, sub, out, centre), then the bias; the product of each part is the one this
        linear calls for every row count the one-call layer takes (1..QUANT_ROWS), so the bits are the same.
        None where a part has no such product (no kernels, in-features not a multiple of 32)."""
        if cpu_kernels() is None:
            return None
        out = []
        for w in self.parts:
            name = product(w, 1, self.arithmetic)
            if w.shape[1] % 32 or name not in LAYER_PRODUCTS or product(w, QUANT_ROWS, self.arithmetic) != name:
                return None
            out += [layer_spec(name, w), w.codes, w.d, w.m]
        return [*out, self.bias if self.bias is not None else torch.empty(0)]

    def __call__(self, x: torch.Tensor, quant: bool = False) -> torch.Tensor:  # [m, in] -> [m, out]
        x = x.contiguous()
        outs = [_block_product(w, x, self.arithmetic) for w in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y if self.bias is None else y + self.bias


def _block_product(weight, x: torch.Tensor, arithmetic: str = "fp32") -> torch.Tensor:
    name = product(weight, x.shape[0], arithmetic)
    if name == "blocks":
        return weight.matmul(x)
    if name == "q8":
        return q8_product(weight, x)
    raise ValueError(f"product {name!r} is listed in PRODUCTS but not dispatched in backend.linear._block_product")


def for_arithmetic(weight, arithmetic: str, arena=None):
    """`weight` (a PackedWeight) in the form its product in `arithmetic` multiplies: the q8 product's tiles
    (`kernels.q8.prepare`, made once here, in `arena` when given) where `PRODUCT_TABLES` gives it the q8 product and
    the kernels are compiled, else itself (without the kernels q8's product is its numpy reference, which takes the
    PackedWeight)."""
    from draftverify.kernels.blocks import PackedWeight

    if not isinstance(weight, PackedWeight) or product(weight, 1, arithmetic) != "q8" or cpu_kernels() is None:
        return weight
    from draftverify.kernels.q8 import prepare

    return prepare(weight, arena)


def concat_runs(weights: list) -> list:
    """Runs of consecutive PackedWeights of one layout and sub-block size, each concatenated along out (a weight
    already in a product's own form, `for_arithmetic`, stays as it is)."""
    from draftverify.kernels.blocks import PackedWeight

    runs: list[list] = []
    for w in weights:
        if not isinstance(w, PackedWeight):
            runs.append([w])
            continue
        last = runs[-1][0] if runs else None
        if isinstance(last, PackedWeight) and (last.layout, last.sub) == (w.layout, w.sub):
            runs[-1].append(w)
        else:
            runs.append([w])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
            continue
        first, n = run[0], sum(w.shape[0] for w in run)
        names = "|".join(dict.fromkeys(w.type_name for w in run))
        cat = lambda ts: torch.cat(ts) if ts[0].numel() else ts[0]  # noqa: E731
        out.append(
            PackedWeight(
                names, (n, first.shape[1]), first.layout, first.sub,
                torch.cat([w.codes for w in run]), cat([w.d for w in run]), cat([w.m for w in run]),
            )
        )  # fmt: skip
    return out


def q8_weight(blocks):
    """Exact Q4_1 / Q8_0 `Blocks` in the q8 product's tiles (None: no such blocks)."""
    if blocks is None or blocks.kind not in ("q4_1", "q8_0"):
        return None
    from draftverify.kernels.q8 import from_blocks, prepare

    return prepare(from_blocks(blocks))


MAX_RUNS = 4  # the most runs of blocks a weight of csrc/region.cpp may have (ops.h kMaxRuns)
LAYER_PRODUCTS = {"blocks": 0, "q8": 1}  # the products csrc/layer.cpp's `dv::quant_product` runs, by its code


def layer_spec(name: str, weight) -> torch.Tensor:
    """A weight's spec as `dv::quant_product` reads it: int64 [product, layout, sub, out, centre]."""
    from draftverify.kernels.blocks import LAYOUTS
    from draftverify.kernels.q8 import TILE_LAYOUTS

    layout = (TILE_LAYOUTS if name == "q8" else LAYOUTS)[weight.layout]
    spec = [LAYER_PRODUCTS[name], layout, weight.sub, weight.shape[0], getattr(weight, "centre", -1)]
    return torch.tensor(spec, dtype=torch.int64)


def q8_runs(weight: list) -> bool:
    """Whether a one-call layer's weight ({spec, codes, d, m} a run, then the bias) is q8 products only: what
    csrc/region.cpp runs (`dv::q8_runs`)."""
    runs = weight[:-1:4]  # the specs: int64 [product, ...]
    return len(weight) % 4 == 1 and len(runs) <= MAX_RUNS and all(int(s[0]) == LAYER_PRODUCTS["q8"] for s in runs)


def q8_layer_weight(weight, bias: torch.Tensor | None) -> list:
    """A q8 weight (`Q8Weight`) as `dv::quant_product` takes it: {spec, codes, d, m}, then the bias: the product
    `q8_product` calls, the bias added after it (one fp32 add either way)."""
    return [layer_spec("q8", weight), weight.codes, weight.d, weight.m, bias if bias is not None else torch.empty(0)]


def q8_product(weight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] @ W^T (+ bias) in the q8 arithmetic (kernels/q8.py): each row rounded to int8 per 32 alone."""
    from draftverify.kernels.q8 import matmul

    return matmul(weight, x.contiguous(), bias)


def layer_weights(qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear) -> list | None:
    """A layer's products as the kernels' one-call `layer` takes them, or None unless every one is quantized."""
    weights = [lin.quant for lin in (qkv, o, gate_up, down)]
    return weights if all(w is not None for w in weights) else None
