"""One table over several bench reports: `python -m draftverify.bench.digest DIR... --out FILE | --readme FILE`.

Each report folder's `results.json` (what `draftverify bench` wrote) gives the figures. `--out` writes a page with
one row per report: the target file and its arithmetic, autoregressive tokens/s, each other method's speedup (end to
end and decode-only, whether its tokens equal autoregressive decoding's), the forward cost curve's t(1) beside
llama.cpp's on the same file and t(8)/t(1), and the time to first token. `--readme` rewrites only the block between
`<!-- results:begin -->` and `<!-- results:end -->` of an existing page (the project's README) with one row per
method of each report, every figure a link to the report behind it. Nothing is typed in: the table says which
command wrote it and is rewritten whole (atomically) each run, so a table that summarises reports comes from them.
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


def _load(folder: Path) -> dict:
    try:
        return json.loads((folder / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"digest: {folder}/results.json is not a bench report ({exc}): run draftverify bench first")


def row(folder: Path) -> tuple[str, list[str]]:
    """(the report's link text, its cells) from `folder/results.json`."""
    results = _load(folder)
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


BEGIN, END = "<!-- results:begin", "<!-- results:end -->"
README_HEADER = ["method", "tokens/s", "speedup over autoregressive [min, max]", "decode-only speedup", "output"]


def _stat(summary: dict, method: str, key: str, fmt: str) -> str:
    value = summary.get(method, {}).get(key)
    if not isinstance(value, dict):
        return "-" if value is None else fmt.format(value)
    text = fmt.format(value["median"])
    return text if value.get("n", 1) < 2 else f"{text} [{fmt.format(value['min'])}, {fmt.format(value['max'])}]"


def _output(method: str, baseline: str, check: dict) -> str:
    """Whether `method`'s tokens equal the baseline's (llama.cpp rounds its own way, so it is named as such)."""
    differ = check.get("differ")
    if method == baseline:
        return "baseline"
    if differ is None:
        return "-"
    if differ == 0:
        return "identical"
    return (
        "its own rounding" if method.startswith("llamacpp") else f"{differ} of {check.get('compared')} prompts differ"
    )


def method_rows(folder: Path, link: str) -> list[str]:
    """The README rows of the report in `folder`: a row naming it, then one per method, each figure linking `link`."""
    results = _load(folder)
    config, summary, env = results["config"], results["summary"]["all"], results.get("environment") or {}
    baseline = results.get("baseline", "autoregressive")
    target, machine = Path(str(config["target"])).name, env.get("gpu") or env.get("cpu", "?")
    facts = [f"`{target}`", str(config.get("arithmetic")), f"{config.get('prompts', '?')} prompts", machine]
    head = f"[{folder.name}]({link}): " + ", ".join(facts)
    rows = ["| " + " | ".join([f"**{head}**", *[""] * (len(README_HEADER) - 1)]) + " |"]
    for method in config["methods"]:
        cells = [_stat(summary, method, "tokens_per_s", "{:.1f}")]
        for key in ("speedup", "decode_speedup"):
            cells.append("1.00x" if method == baseline else _stat(summary, method, key, "{:.2f}x"))
        cells = [c if c == "-" else f"[{c}]({link})" for c in cells]
        output = _output(method, baseline, results.get("exactness", {}).get(method, {}))
        rows.append("| " + " | ".join([f"`{method}`", *cells, output]) + " |")
    return rows


def readme(folders: list[Path], page: Path, command: str) -> str:
    """Rewrite the results block of `page` (between BEGIN and END) from the reports in `folders`."""
    try:
        text = page.read_text()
    except OSError as exc:
        raise SystemExit(f"digest: cannot read {page} ({exc}): name the page whose results block to rewrite")
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise SystemExit(
            f"digest: {page} has no '{BEGIN} -->' ... '{END}' block: add the two markers where the table goes"
        )
    lines = [f"{BEGIN}: written by `{command}` -->", "", "| " + " | ".join(README_HEADER) + " |"]
    lines.append("|" + "---|" * len(README_HEADER))
    for folder in folders:
        link = os.path.relpath(folder.absolute() / "report.md", page.absolute().parent)
        lines += method_rows(folder, link)
    new = text[:start] + "\n".join(lines) + "\n\n" + text[stop:]
    with atomic_path(page) as tmp:
        tmp.write_text(new)
    return new


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftverify.bench.digest", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="bench report folders (each with results.json)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", type=Path, help="the markdown page to write, one row per report")
    target.add_argument("--readme", type=Path, help="a page whose results block to rewrite, one row per method")
    parser.add_argument("--title", default=TITLE, help="the page's heading (with --out)")
    args = parser.parse_args(argv)
    command = "python -m draftverify.bench.digest " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.readme is not None:
        readme(args.folders, args.readme, command)
    else:
        digest(args.folders, args.out, command, args.title)
    print(f"digest: {args.readme or args.out}")


if __name__ == "__main__":
    main()
