"""What a curve's measured times depend on, as the key of its file: the machine, the model, its arithmetic, the
kernel build, the path and the widths."""

from __future__ import annotations

import functools
import hashlib

import torch

from draftverify.costs.timing import TIMING
from draftverify.machine import cpu_model, native_flags
from draftverify.models import Runner


@functools.cache
def machine() -> dict:
    """What a forward's time depends on in the machine: the CPU's model name and flags (hashed: a long list)."""
    flags = " ".join(sorted(native_flags()))
    return {"cpu": cpu_model(), "cpu_flags": hashlib.sha1(flags.encode()).hexdigest()[:12]}


@functools.cache
def kernel_build() -> str:
    """The kernels' build tag (a hash of their sources and the instruction set they are built for) and torch's
    version: a rebuild can change any time."""
    from draftverify.kernels import isa, source_tag

    return f"{source_tag()}-{isa()}-torch{torch.__version__}"


def curve_key(runner: Runner, all_logits: bool, widths) -> dict:
    """Everything a curve's measured times depend on (see `draftverify.costs`), as JSON values."""
    from draftverify.loading.hf import model_identity

    device = runner.device
    return {
        **machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "model": model_identity(runner.model),
        # the engine's arithmetic (q8 or fp32: the same weights' forwards cost differently) and the weights' dtype
        "arithmetic": f"{runner.shared.packs.arithmetic} {runner.dtype}",
        "timing": TIMING,
        "kernels": kernel_build(),
        "backend": runner.backend,
        "draft": runner.draft,
        "all_logits": all_logits,
        "widths": list(widths),
    }
