"""What draftverify's CUDA path spends a decoding step on, for a model of the default target's shape.

    python scripts/cuda_probe.py make-model --config CONFIG.json --tokenizer DIR --out DIR [--layers N]
    python scripts/cuda_probe.py measure [--model DIR|FILE] [--draft DIR] [--backends eager,static,graph]
                                         [--dtype auto|bf16|fp32] --out FILE.json
    python scripts/cuda_probe.py report --probe FILE.json --command "..." --out REPORT.md

`make-model` writes a randomly initialised model (seed 0) of the shape `CONFIG.json` gives, in bf16, with the
tokenizer files of DIR (with `--layers`, that many layers: a draft of the same kind): the forward's cost depends
on shapes, not on weights, so it stands in for a target that cannot travel to the GPU machine.
`measure` writes, for that model (or any target: the default model without `--model`) on CUDA, per backend: wall
and CUDA-kernel milliseconds per generated token (autoregressive, and speculative with the draft, or the default
model's feature head), host synchronisations per target forward (counted with `torch.cuda.set_sync_debug_mode("warn")`)
and where the host time of autoregressive decoding goes (cProfile). `report` renders such a file as markdown. Random
weights accept nothing, so on a `make-model` model `speculative` is every round's cost with nothing gained;
docs/backends.md says what the numbers mean.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import warnings
from pathlib import Path

import torch

from draftverify.util import atomic_write

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_model(config: Path, tokenizer: Path, out: Path, layers: int | None = None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config.read_text())
    raw.pop("quantization_config", None)
    raw["num_hidden_layers"] = layers or raw["num_hidden_layers"]
    raw["dtype"] = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)


def count_syncs(fn) -> int:
    """Synchronising CUDA calls made while `fn` runs."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_top(fn, rows: int = 15) -> list[dict]:
    """The functions `fn` spends most of its own host time in (cProfile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    top = []
    for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        top.append(dict(function=f"{Path(path).name}:{line}({name})", calls=calls, own_s=own, cumulative_s=cumulative))
    return sorted(top, key=lambda row: -row["own_s"])[:rows]


def kernel_ms(fn) -> float:
    """Milliseconds the GPU spent in CUDA kernels while `fn` ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def backend_figures(engine, prompt: str, tokens: int) -> dict:
    """Per method: wall and kernel milliseconds per token, host synchronisations per target forward."""

    def decode(method: str):  # past EOS, so every run decodes `tokens`
        return engine.generate(prompt, method=method, max_new_tokens=tokens, eos_token_id=[])

    out = {}
    for method in ("autoregressive", "speculative"):
        decode(method)  # warm-up at every length it will see
        result = {}

        def run():
            result["r"] = decode(method)

        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        n, stats = len(result["r"].tokens), result["r"].stats
        out[method] = dict(
            tokens=n,
            target_forwards=stats.target_forwards,
            wall_ms_per_token=wall * 1e3 / n,
            kernel_ms_per_token=kernel_ms(run) / n,
            syncs_per_target_forward=count_syncs(run) / max(1, stats.target_forwards),
        )
    out["autoregressive"]["host_profile"] = profile_top(lambda: decode("autoregressive"))
    return out


RANDOM_MODEL = (
    "a randomly initialised model of the default target's shape (bf16) and a 4-layer draft of the same kind, "
    "64 new tokens after a warm-up over the same lengths. Random weights accept no draft: `speculative` here is "
    "every round's cost with nothing gained."
)


def measure(model: str | None, draft: str | None, out: Path, backends=("eager", "static"), dtype="auto") -> None:
    import transformers

    from draftverify import Engine

    prompt = "Explain why the sky is blue, in three short paragraphs."
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__)
    report["backends"] = list(backends)
    for backend in backends:
        engine = Engine.load(target=model, draft=draft, device="cuda", backend=backend, dtype=dtype)
        report[backend] = backend_figures(engine, prompt, tokens=64)
        report["about"] = (
            f"target {engine.target.name} ({engine.describe_drafts()}), weights {engine.target_runner.dtype}, "
            "64 new tokens after a warm-up over the same lengths."
        )
        del engine
    text = json.dumps(report, indent=1)
    atomic_write(out, text)
    print(text)


def report(probe: Path, command: str, out: Path) -> None:
    data = json.loads(probe.read_text())
    lines = [
        "# draftverify's CUDA path: where a decoding step goes",
        "",
        f"```\n{command}\n```",
        "",
        f"- {data['gpu']}; torch {data['torch']}, transformers {data['transformers']}; "
        f"{data.get('about', RANDOM_MODEL)}",
        "- GPU busy = CUDA-kernel time / wall time; the rest is the host (Python, launches) with the GPU idle.",
        "",
        "| backend | method | wall ms / token | kernel ms / token | GPU busy | host syncs / target forward |",
        "|---|---|---|---|---|---|",
    ]
    backends = data.get("backends", ("eager", "static"))
    for backend in backends:
        for method in ("autoregressive", "speculative"):
            row = data[backend][method]
            busy = row["kernel_ms_per_token"] / row["wall_ms_per_token"]
            lines.append(
                f"| {backend} | `{method}` | {row['wall_ms_per_token']:.1f} | {row['kernel_ms_per_token']:.2f} "
                f"| {busy:.0%} | {row['syncs_per_target_forward']:.1f} |"
            )
    for backend in backends:
        lines += ["", f"## Host time of autoregressive decoding, {backend} backend (cProfile, own time)", ""]
        lines += ["| function | calls | own s | cumulative s |", "|---|---|---|---|"]
        for row in data[backend]["autoregressive"]["host_profile"][:10]:
            function = row["function"].replace("|", "\\|")
            lines.append(f"| `{function}` | {row['calls']} | {row['own_s']:.3f} | {row['cumulative_s']:.3f} |")
    atomic_write(out, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model")
    make.add_argument("--config", type=Path, required=True)
    make.add_argument("--tokenizer", type=Path, required=True)
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--layers", type=int)
    run = sub.add_parser("measure")
    run.add_argument("--model", help="a model folder or GGUF file (default: the default model)")
    run.add_argument("--draft", help="a draft model (default: the default model's feature head, if any)")
    run.add_argument("--backends", default="eager,static", help="comma-separated backends to measure")
    run.add_argument("--dtype", default="auto", help="the target's dtype (auto: fp32)")
    run.add_argument("--out", type=Path, required=True)
    render = sub.add_parser("report")
    render.add_argument("--probe", type=Path, required=True)
    render.add_argument("--command", required=True, help="the commands that wrote the probe file, for the report")
    render.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.config, args.tokenizer, args.out, args.layers)
    elif args.command == "measure":
        measure(args.model, args.draft, args.out, args.backends.split(","), args.dtype)
    else:
        report(args.probe, args.command, args.out)


if __name__ == "__main__":
    main()
