"""Measuring from outside a generation: device sync, peak memory, forward calls, chunk times."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so that wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict that holds, after the block, `peak_mem_bytes` and `mem_kind`.

    CUDA: torch.cuda.max_memory_allocated over the block ("cuda_max_allocated").
    CPU: the process's peak resident set size over the block, after resetting the kernel's
    high-water mark through /proc/self/clear_refs ("process_peak_rss": process-wide, so it
    includes the models' weights); where that reset is not allowed, the growth of the
    process's lifetime maximum RSS during the block ("process_max_rss_growth").
    """
    out: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        out.update(peak_mem_bytes=torch.cuda.max_memory_allocated(device), mem_kind="cuda_max_allocated")
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (Linux >= 4.0)
        reset = True
    except OSError:
        reset = False
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    yield out
    if reset:
        status = Path("/proc/self/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
        out.update(peak_mem_bytes=kib * 1024, mem_kind="process_peak_rss")
    else:
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.update(peak_mem_bytes=after - before, mem_kind="process_max_rss_growth")


class ForwardCounter:
    """Counts a module's forward calls and records the `logits_to_keep` each was asked for."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.calls = 0
        self.kept: list[int | None] = []

    def __enter__(self) -> "ForwardCounter":
        self.handle = self.model.register_forward_pre_hook(self._count, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _count(self, module, args, kwargs) -> None:
        self.calls += 1
        keep = kwargs.get("logits_to_keep")
        self.kept.append(keep if isinstance(keep, int) and keep > 0 else None)


class ChunkClock(BaseStreamer):
    """A transformers streamer that notes the size and arrival time of every emitted chunk."""

    def __init__(self, start: float):
        self.start = start
        self.prompt_seen = False
        self.chunks: list[int] = []
        self.times: list[float] = []  # seconds from `start`, one per token (a chunk's tokens share its time)

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() streams the prompt first
            self.prompt_seen = True
            return
        now = time.perf_counter() - self.start
        self.chunks.append(value.numel())
        self.times.extend([now] * value.numel())

    def end(self) -> None:
        pass


def environment(device: torch.device) -> dict:
    """Versions, hardware and thread count, for results.json."""
    import transformers

    import draftverify
    from draftverify.kernels import cpu_flags, has_avx512
    from draftverify.machine import cpuinfo

    cpu = cpuinfo().get("model name") or platform.processor() or ""

    # the vector width the forward path's kernels get: it moves every curve
    vector = "AVX-512" if has_avx512() else "AVX2" if "avx2" in cpu_flags() else None
    cpu = f"{cpu}, {vector}" if cpu and vector else cpu
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "draftverify": draftverify.__version__,
        "git_commit": commit,
        "platform": platform.platform(),
        "cpu": cpu,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
