"""One table over several bench reports: `python -m draftverify.bench.digest DIR... --out FILE`.

Each report folder's `results.json` (what `draftverify bench` wrote) gives one row: the target file and its
arithmetic, autoregressive tokens/s, each other method's speedup (end to end and decode-only, whether its tokens
equal autoregressive decoding's), the forward cost curve's t(1) beside llama.cpp's on the same file and t(8)/t(1),
and the time to first token. Nothing is typed in: the page says which command wrote it, and is rewritten whole
(atomically) each run, so the numbers in docs/benchmarks/ that summarise several reports come from those reports.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from draftverify.util import atomic_path


def _median(summary: dict, method: str, key: str) -> float | None:
    value = summary.get(method, {}).get(key)
    return value.get("median") if isinstance(value, dict) else value


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def row(folder: Path) -> tuple[str, list[str]]:
    """(the report's link text, its cells) from `folder/results.json`."""
    try:
        results = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"digest: {folder}/results.json is not a bench report ({exc}): run draftverify bench first")
    config, summary = results["config"], results["summary"]["all"]
    baseline = results.get("baseline", "autoregressive")
    exact = results.get("exactness", {})
    methods = []
    for method in config["methods"]:
        if method == baseline:
            continue
        differ = exact.get(method, {}).get("differ")
        same = "" if differ == 0 else " (tokens differ)" if method.startswith("llamacpp") else f" ({differ} differ)"
        end, decode = _median(summary, method, "speedup"), _median(summary, method, "decode_speedup")
        methods.append(f"`{method}` {_ratio(end)} / {_ratio(decode)}{same}")
    curve = results.get("cost_model") or {}
    target, peer = curve.get("target", {}), curve.get("llamacpp", {})
    t1, t8, p1 = target.get("1"), target.get("8"), peer.get("1")
    ttft = _median(summary, baseline, "ttft_p50_s")
    cells = [
        f"`{Path(str(config['target'])).name}`",
        str(config.get("arithmetic") or config.get("dtype")),
        f"{_median(summary, baseline, 'tokens_per_s'):.1f}",
        "<br>".join(methods) or "-",
        "-" if t1 is None or p1 is None else f"{t1 * 1e3:.1f} / {p1 * 1e3:.1f} ({p1 / t1:.2f}x)",
        "-" if t1 is None or t8 is None else f"{t8 / t1:.2f}",
        "-" if ttft is None else f"{ttft * 1e3:.0f}",
    ]
    return folder.name, cells


HEADER = [
    "report",
    "target file",
    "arithmetic",
    "autoregressive tokens/s",
    "speedup over autoregressive: end to end / decode-only",
    "one-token forward, ms: ours / llama.cpp's (its ratio)",
    "t(8) / t(1)",
    "TTFT p50, autoregressive (ms)",
]


TITLE = "Latest bench reports at a glance"


def digest(folders: list[Path], out: Path, command: str, title: str = TITLE) -> str:
    lines = [
        f"# {title}",
        "",
        f"Written by `{command}` from each report's `results.json`; every number links back to its report (the",
        "command that ran it is that report's first line). Speedups are geometric means over the report's prompts;",
        "a method's tokens equal autoregressive decoding's unless the cell says otherwise (llama.cpp rounds its own",
        "way). The forward columns are the report's cost curve: one forward after 128 tokens of context.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for folder in folders:
        name, cells = row(folder)
        link = f"[{name}]({os.path.relpath(folder.absolute() / 'report.md', out.absolute().parent)})"
        lines.append("| " + " | ".join([link, *cells]) + " |")
    text = "\n".join(lines) + "\n"
    with atomic_path(out) as tmp:
        tmp.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftverify.bench.digest", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="bench report folders (each with results.json)")
    parser.add_argument("--out", type=Path, required=True, help="the markdown page to write")
    parser.add_argument("--title", default=TITLE, help="the page's heading")
    args = parser.parse_args(argv)
    command = "python -m draftverify.bench.digest " + shlex.join(sys.argv[1:] if argv is None else argv)
    digest(args.folders, args.out, command, args.title)
    print(f"digest: {args.out}")


if __name__ == "__main__":
    main()
