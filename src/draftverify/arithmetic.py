"""The target's arithmetic: "fp32" (every product in fp32: transformers' arithmetic on the same weights) or "q8"
(kernels/q8.py: the target's block-weight linears multiply int8-rounded activations with the weight's own codes,
at every row count, prefill included; attention, norms, embedding and everything else stay fp32).

Autoregressive decoding in the engine's arithmetic is what every method is identical to: greedy output token for
token, sampling exactly distributed. `Engine.load(dtype=...)` takes the arithmetic beside the weights' dtype:
"q8" (fp32 weights, q8 products), "fp32" / "bf16" / "fp16" (that arithmetic, always), "auto" (`default_arithmetic`).

The default rule (`default_arithmetic`): q8 when all of these hold (and `Q8_DEFAULT` is on), else fp32:
- the target is a GGUF file whose layers have quantized block weights (`quantized_layers`: Q4_0 .. Q8_0, the
  K-quants; their codes are what q8 multiplies; a safetensors target, or a GGUF file of F32 / F16 / BF16 layers,
  stays fp32),
- the backend may be the static path's (`auto` or `static`: the eager and graph backends multiply the stock
  module's weights, which have no q8 product),
- the target runs on the CPU and the compiled CPU kernels load there: they multiply with the CPU's integer dot
  products (AVX-512 VNNI `vpdpbusd`, AVX-VNNI's, or AVX2's `maddubs`; every CPU the kernels build for has AVX2 at
  least; the same bits on each, docs/q8.md); without the kernels q8 would run on a numpy reference, far slower
  than fp32.
The rule reads the file, never its name: any quantized GGUF file gets q8. `python -m draftverify.tools.quality`
(`draftverify quality`) measures, for any target, q8's perplexity and greedy agreement against fp32's, the evidence
for the rule (`PPL_TOLERANCE` is the bound its report checks).
`Q8_DEFAULT` is the switch for the whole rule: on since the q8 products (weights in tiles of 16 outputs, one
int8 dot-product instruction for 16 outputs) decode faster than fp32's and make verified rows cheaper (docs/q8.md
links the bench reports that show it); off, every target runs in fp32 unless asked for q8.
"""

from __future__ import annotations

from pathlib import Path

ARITHMETICS = ("fp32", "q8")
PPL_TOLERANCE = 0.01  # the bound the quality report checks: q8's perplexity at most 1% above fp32's
Q8_DEFAULT = True  # see the module docstring


def split_dtype(dtype: str) -> tuple[str, str | None]:
    """`--dtype` -> (the weights' dtype for `load_model`, the arithmetic; None: decide by `default_arithmetic`)."""
    if dtype == "q8":
        return "fp32", "q8"
    if dtype == "auto":
        return "auto", None
    return dtype, "fp32"


def within_tolerance(record: dict | None) -> bool:
    """Whether a quality record (`tools.quality`) says q8's perplexity is within `PPL_TOLERANCE` of fp32's."""
    if not record or not {"ppl_fp32", "ppl_q8"} <= record.keys():
        return False
    return float(record["ppl_q8"]) <= float(record["ppl_fp32"]) * (1 + PPL_TOLERANCE)


def quantized_layers(path: Path, file=None) -> bool:
    """Whether the GGUF file at `path` (`file`: it, already opened) has layer weights in a block format whose
    codes the q8 product multiplies (`kernels.blocks.KERNELS`' "u4" / "u8" layouts)."""
    from draftverify.kernels.blocks import KERNELS
    from draftverify.kernels.gguf_file import GGUFFile
    from draftverify.kernels.q8 import CODE_LAYOUTS

    file = file if file is not None else GGUFFile(path)
    return any(
        name.startswith("blk.") and KERNELS.get(info.ggml_type, ("",))[0] in CODE_LAYOUTS
        for name, info in file.tensors.items()
    )


def default_arithmetic(
    source: Path | str | None, device: str = "cpu", backend: str = "auto", file=None
) -> tuple[str, str]:
    """The rule of this module's docstring for a target loaded from `source` to run on `backend`: (arithmetic, why
    in a few words). `file`: the GGUF file at `source`, already opened (`kernels.gguf_file.GGUFFile`)."""
    from draftverify.kernels import cpu, unavailable

    path = Path(source) if source is not None else None
    if path is None or path.suffix != ".gguf":
        return "fp32", "the target is not a GGUF file"
    if backend not in ("auto", "static"):
        return "fp32", f"backend {backend!r} has no q8 products"
    if device != "cpu":
        return "fp32", f"the target runs on {device}"
    if not Q8_DEFAULT:
        return "fp32", "q8 is switched off (arithmetic.Q8_DEFAULT)"
    if not quantized_layers(path, file):
        return "fp32", f"{path.name} has no quantized layer weights for q8 to multiply"
    if cpu() is None:  # asked last: the first call of a machine builds them (minutes)
        return "fp32", f"no compiled CPU kernels for q8's integer products here ({unavailable()})"
    return "q8", f"{path.name} has quantized layer weights and this CPU runs q8's integer products"


def q8_linears(runner) -> int:
    """How many of a runner's linears take the q8 product (0 on the eager path or with no block weights)."""
    decoder = getattr(runner, "decoder", None)
    layers = list(getattr(decoder, "layers", None) or [])
    linears = [lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(getattr(decoder, "head", None))
    return sum(
        1 for lin in linears if getattr(lin, "q8", None) is not None or getattr(lin, "arithmetic", "fp32") == "q8"
    )
