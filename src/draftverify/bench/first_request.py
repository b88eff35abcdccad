"""What a fresh process's first request costs: `python -m draftverify.bench.first_request --out FOLDER`.

Each of `--processes` fresh Python processes loads the engine (`Engine.load`, the default model unless `--target`),
sends `--requests` identical requests of `--method`, then loads it again; the import and load times, the time to
first token and the whole time of each request, and the first one's ratios to the fastest later one, go in
`FOLDER/report.md` (the command on its first line, written atomically). The first process loads a GGUF file as for
the first time: the file's converted config and tokenizer (`loading.gguf.gguf_metadata`, a cache) are removed
before it starts, so it converts them again; the later processes read what it left. `--unseen`: the machine has
never timed the model either: the processes keep their cost curves in a folder of the run's own (the rest of the
cache is the user's, through links), so the first one measures them and the later ones read what it left; the
user's curves are not touched.
A first request pays for whatever a process does once: compiling or importing the kernels, measuring or reading the
cost curves (`costs.curve`, cached on disk per machine, model, arithmetic and kernel build), loading a lazily
loaded draft. Processes run one after another, so a later one finds what an earlier one left on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from draftverify.loading.gguf import metadata_folder
from draftverify.loading.known import resolve_model
from draftverify.util import atomic_path, command_line

PROBE = """
import json, sys, time
started = time.perf_counter()
from draftverify import Engine
imported = time.perf_counter()
target, method, prompt = sys.argv[1] or None, sys.argv[2], sys.argv[4]
requests, tokens = int(sys.argv[3]), int(sys.argv[5])
load = lambda: Engine.load(target) if target else Engine.load()
started_load = time.perf_counter()
engine = load()
load_s = time.perf_counter() - started_load
transformers = "transformers" in sys.modules  # a cached GGUF file's load imports none of it
stats = [engine.generate(prompt, method=method, chat=True, max_new_tokens=tokens).stats for _ in range(requests)]
arithmetic = engine.arithmetic
del engine
started_again = time.perf_counter()
load()
again_s = time.perf_counter() - started_again
print(json.dumps({"import_s": imported - started, "transformers": transformers, "load_s": load_s,
                  "load_again_s": again_s, "ttft_s": [s.ttft_s for s in stats], "wall_s": [s.wall_s for s in stats],
                  "arithmetic": arithmetic}))
"""
PROMPT = "Explain why the sky is blue in two sentences."


def probe(target: str | None, method: str, requests: int, tokens: int, convert: bool, cache: Path | None = None):
    """One fresh process's load time and per-request times. `convert`: the GGUF file's converted config and
    tokenizer are removed from the cache first (a cache: the load converts them again), so that the process loads
    the file as for the first time. `cache`: the process's cache root (`unseen_cache`), else the user's."""
    path = resolve_model(target or None)  # a short name is fetched here, before the timed processes
    converted = convert and path.suffix == ".gguf"
    if converted:
        shutil.rmtree(metadata_folder(path), ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"XDG_CACHE_HOME": str(cache)} if cache else {})}
    args = [sys.executable, "-c", PROBE, target or "", method, str(requests), PROMPT, str(tokens)]
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"first_request: the probe process failed ({tail[0][:200]})")
    return {**json.loads(run.stdout.strip().splitlines()[-1]), "metadata": "converted" if converted else "cached"}


def unseen_cache(folder: Path) -> Path:
    """A cache base (for `XDG_CACHE_HOME`) under `folder` whose draftverify cache is the user's, every entry linked,
    but for an empty folder of cost curves: a machine that has never timed a model, whose files are otherwise as
    they are."""
    from draftverify.util import cache_root

    mine, user = folder / "draftverify", cache_root()
    mine.mkdir(parents=True, exist_ok=True)
    for entry in user.iterdir() if user.is_dir() else []:
        if entry.name != "curves":
            (mine / entry.name).symlink_to(entry.resolve())
    (mine / "curves").mkdir()
    return folder


def machine_line() -> str:
    """The CPU that ran the processes: model, family and model numbers, the q8 product's instructions, cores."""
    from draftverify.kernels.q8 import instruction_set
    from draftverify.machine import cores, cpu_model, cpuinfo

    info = cpuinfo()
    family = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info else ""
    return f"Machine: {cpu_model()}{family}, q8 product {instruction_set()}, {cores()} cores."


def report(runs: list[dict], command: str, method: str, unseen: bool = False) -> str:
    lines = [
        "# First request of a fresh process",
        "",
        "```",
        command,
        "```",
        "",
        machine_line(),
        "",
        "Each row: one fresh process: `import draftverify`, `Engine.load()` (and whether it imported transformers),",
        f"identical `{method}` requests ({PROMPT!r}, chat), then `Engine.load()` again in the same process.",
        "first / warm: the first request's time to first token, and its whole time, over the fastest later request's.",
        "Cost curves: "
        + (
            "none at the start (`--unseen`): the first process measured them, the later ones read its files."
            if unseen
            else "as this machine had them."
        ),
        "metadata: converted = the process converted the file's config and tokenizer (a file's first load);",
        "cached = it read the conversion an earlier process left.",
        "",
        "| process | metadata | arithmetic | import draftverify (s) | load imports transformers | load (s) "
        "| load again (s) | TTFT per request (ms) | first / warm | request (ms) | first / warm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(runs, 1):
        times = [f"{run[key]:.2f}" for key in ("import_s", "load_s", "load_again_s")]
        imports = "yes" if run["transformers"] else "no"
        cells = [str(i), run.get("metadata", "-"), run["arithmetic"], times[0], imports, *times[1:]]
        for each in (run["ttft_s"], run.get("wall_s")):
            cells += _ratio(each)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio(seconds: list[float] | None) -> list[str]:
    """The cells of one measure per request: the times (ms), and the first's over the fastest later one's."""
    if not seconds:
        return ["-", "-"]
    ratio = seconds[0] / min(seconds[1:]) if len(seconds) > 1 and min(seconds[1:]) > 0 else None
    return [", ".join(f"{t * 1e3:.0f}" for t in seconds), "-" if ratio is None else f"{ratio:.2f}"]


def main(argv: list[str] | None = None) -> None:
    prog = "python -m draftverify.bench.first_request"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="report folder (report.md, runs.json)")
    parser.add_argument("--target", default=None, help="a model folder or .gguf file (default: the default model)")
    parser.add_argument("--method", default="auto", help="the method of every request")
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes, one after another (the first converts the metadata)"
    )
    parser.add_argument("--requests", type=int, default=3, help="requests per process (at least 2)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument(
        "--unseen", action="store_true", help="start with no cost curves (the user's are left as they are)"
    )
    args = parser.parse_args(argv)
    if args.requests < 2 or args.processes < 1:
        raise SystemExit("first_request: --requests must be at least 2 and --processes at least 1")
    command = command_line(prog, sys.argv[1:] if argv is None else argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="first-request-") as scratch:
        cache = unseen_cache(Path(scratch)) if args.unseen else None
        for i in range(args.processes):
            runs.append(probe(args.target, args.method, args.requests, args.max_new_tokens, i == 0, cache))
            print(f"first_request: process {i + 1} of {args.processes} done", file=sys.stderr, flush=True)
    text = report(runs, command, args.method, args.unseen)
    with atomic_path(args.out, folder=True) as tmp:
        (tmp / "report.md").write_text(text)
        (tmp / "runs.json").write_text(json.dumps(runs, indent=1))
    print(text)


if __name__ == "__main__":
    main()
