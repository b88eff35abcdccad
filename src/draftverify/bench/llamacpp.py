"""llama.cpp as a bench peer: what a CPU user runs instead of PyTorch, on the target's own weights.

Three peers, through `llama-cpp-python` (an optional extra, built from source once by
`scripts/install-llamacpp.sh`):

- `llamacpp`: llama.cpp's plain greedy decoding of the target's own GGUF file, the file a
  llama.cpp user runs (its weight blocks through llama.cpp's own kernels);
- `llamacpp-f32`: the same decoding of an F32 re-export of the target's weights, the
  same-arithmetic comparison (fp32 weights and activations, as draftverify's fp32 path);
- `llamacpp-prompt-lookup`: speculative decoding with prompt-lookup drafts on the target's own
  file (`LlamaPromptLookupDecoding`, `num_pred_tokens` drafted tokens per step, default 10).

The F32 re-export holds exactly the weights the target runs with: the GGUF target (the default
model is a Q4_1 GGUF) is de-quantised tensor by tensor, with every metadata key kept, once,
and cached beside the safetensors conversion (written under a temporary name and renamed).
Targets loaded from a folder are refused in one line. `forward_times` measures llama.cpp's
forward times per new-token count, the same buckets as the target's cost model.

llama.cpp's kernels round differently from PyTorch's, so its greedy output may part from
`autoregressive` where two tokens nearly tie: the report marks such rows, and the peers are
there for speed, not as a reference for exactness.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from draftverify.costs import time_widths
from draftverify.errors import require
from draftverify.util import atomic_path, cache_root

INSTALL_HINT = (
    "llama.cpp peers need llama-cpp-python: run `bash scripts/install-llamacpp.sh` (it compiles llama.cpp once)"
)


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def build() -> str:
    """The llama.cpp build the peers run: llama-cpp-python's version and the CPU features llama.cpp was compiled with
    (its system info line), e.g. whether its AMX backend is in (scripts/install-llamacpp.sh leaves it out)."""
    import llama_cpp

    features = cpu_features(llama_cpp.llama_print_system_info().decode(errors="replace"))
    return f"llama-cpp-python {llama_cpp.__version__} ({', '.join(features) or 'no CPU features listed'})"


def cpu_features(info: str) -> list[str]:
    """The features llama.cpp's system info marks on in its CPU line ("CPU : SSE3 = 1 | ... | AMX_INT8 = 1 | ...")."""
    line = next((part.strip() for part in info.splitlines() if part.strip().startswith("CPU :")), "")
    pairs = (item.split("=") for item in line.removeprefix("CPU :").split("|") if "=" in item)
    return [name.strip() for name, value in pairs if value.strip() == "1"]


def require_llamacpp() -> None:
    require(available(), INSTALL_HINT)


def source_key(source: Path) -> str:
    """What names a cached derivative of `source`: its resolved path, size and modification time."""
    stat = source.stat()
    return hashlib.sha1(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def f32_gguf(source: Path) -> Path:
    """An F32 copy of the GGUF file `source` (cached): same metadata, every tensor de-quantised."""
    import gguf

    out = cache_root() / "gguf-f32" / f"{source.stem}-{source_key(source)}.F32.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue  # the writer writes these itself
            value = int(gguf.LlamaFileType.ALL_F32) if name == "general.file_type" else field.contents()
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, vtype, sub_type=sub)
        for tensor in reader.tensors:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            writer.add_tensor(tensor.name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


GGUF_KINDS = ("file", "f32")  # the target's own GGUF file; its F32 re-export
COST_KEYS = {"file": "llamacpp", "f32": "llamacpp-f32"}  # the cost model's key of each one's forward times


def gguf_for(source: Path | None, name: str, kind: str = "file") -> Path:
    """The GGUF a llama.cpp peer runs: the target's own file (`kind="file"`) or its F32 re-export ("f32")."""
    require(kind in GGUF_KINDS, f"unknown GGUF kind {kind!r}: use one of {', '.join(GGUF_KINDS)}")
    require(
        source is not None and source.suffix == ".gguf",
        f"llama.cpp peers need a .gguf target, and {name} was loaded from a folder: pass the model as a .gguf file "
        "(llama.cpp's convert_hf_to_gguf.py writes one) or drop the llamacpp peers",
    )
    return source if kind == "file" else f32_gguf(source)


def peer(spec, source: Path | None, name: str, n_ctx: int) -> "LlamaCpp":
    """The llama.cpp instance behind the bench spec `spec` (a llama.cpp peer: `spec.gguf` says which file)."""
    import torch

    require_llamacpp()
    lookup = spec.config.num_pred_tokens if spec.name == "llamacpp-prompt-lookup" else None
    return LlamaCpp(gguf_for(source, name, spec.gguf), n_ctx, torch.get_num_threads(), prompt_lookup=lookup)


class LlamaCpp:
    """One llama.cpp model (a GGUF of the target) with the bench's threads and context."""

    def __init__(
        self, path: Path, n_ctx: int, threads: int, prompt_lookup: int | None = None, logits_all: bool = False
    ):
        require_llamacpp()
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
        # With a draft model llama-cpp-python keeps every row's logits but sizes its buffer from
        # the `logits_all` argument (0.3.36): say True, or a context past 512 tokens overflows it.
        self.llm = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            logits_all=logits_all or draft is not None,
            draft_model=draft,
            verbose=False,
        )

    def generate(self, ids: list[int], sampling, max_new_tokens: int, eos: tuple[int, ...]) -> dict:
        """Decode `ids` (greedy, or sampled with the same temperature / top-k / top-p); returns the
        bench record's measured fields. What llama.cpp does inside is not observable: forward
        counts, drafts and the time split are None ("unknown")."""
        if sampling.greedy:
            knobs = dict(top_k=1, top_p=1.0, temp=0.0)
        else:
            knobs = dict(top_k=sampling.top_k, top_p=sampling.top_p, temp=sampling.temperature)
            if sampling.seed is not None:
                self.llm.set_seed(sampling.seed)
        # llama-cpp-python's generate reuses the longest prefix of the previous request still in its cache (all of
        # a repeated prompt, a multi-turn prompt's earlier turns); ours prefills every request whole, and so must it
        self.llm.reset()
        start = time.perf_counter()
        tokens, times = [], []
        for token in self.llm.generate(ids, min_p=0.0, repeat_penalty=1.0, reset=True, **knobs):
            tokens.append(int(token))
            times.append(time.perf_counter() - start)
            if token in eos or len(tokens) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        return {
            "tokens": tokens,
            "new_tokens": len(tokens),
            "wall_s": wall,
            "ttft_s": times[0] if times else None,
            "token_times": times,
            "target_forwards": None,
            "draft_forwards": None,
            "drafted": None,
            "accepted": None,
            "steps": None,
            "draft_s": None,
            "verify_s": None,
            "finish_reason": "eos" if tokens and tokens[-1] in eos else "length",
            "extra": {},
        }

    def forward_times(self, context: list[int], widths, reps: int = 5) -> dict[int, float]:
        """Seconds of one forward of w new tokens after `context` (fastest of `reps`), per width."""
        llm = self.llm
        llm.reset()
        llm.eval(context)
        base = llm.n_tokens

        def rollback() -> None:
            llm.n_tokens = base  # eval() drops the cache past n_tokens first

        return time_widths(llm.eval, rollback, context, widths, reps)
