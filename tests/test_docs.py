"""The front door and the docs: every relative link resolves, the README stays short and its results come from
the generator, and no page points at work history (issue numbers)."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if not file.exists():
            bad.append(target)
        elif anchor and file.suffix == ".md":
            if anchor not in {slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}:
                bad.append(target)
    return bad


def test_every_relative_link_and_anchor_resolves():
    bad = {str(page.relative_to(ROOT)): broken_links(page) for page in PAGES}
    assert not {k: v for k, v in bad.items() if v}, "links to files or headings that do not exist"


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title here\n[ok](a.md#title-here) [gone](b.md) [no](#nowhere) [web](https://x.org/y)\n")
    assert broken_links(page) == ["b.md", "#nowhere"]


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200
    assert any("bash scripts/demo.sh" in line for line in lines[:40])
    assert any("bash scripts/test.sh" in line for line in lines[:40])
    block = text[text.index("<!-- results:begin") : text.index("<!-- results:end -->")]
    assert "written by `python -m draftverify.bench.digest" in block and "| `auto` |" in block


def test_no_page_names_an_issue_number():
    found = [f"{p.name}: {m}" for p in PAGES for m in re.findall(r"\bissues? [0-9]+", p.read_text(), re.I)]
    assert not found
