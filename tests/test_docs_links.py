"""The README and docs/ as a newcomer reads them: every relative link resolves (to a file,
and to a heading where it names one), the README stays short and opens with a command to
run, and each headline figure in it is one that docs/BENCHMARKS.md holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

README_MAX_BYTES = 12 * 1024
FIRST_COMMAND_WITHIN_LINES = 30

# [text](target) and ![alt](target), with an optional "title"; code is stripped first.
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def prose_lines(text: str, *, drop_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) of ``text`` outside fenced code blocks, inline code removed
    (with ``drop_code``) or kept."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub("", line) if drop_code else line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text(), drop_code=False):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in ``page`` that is not to another site."""
    links = []
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:
                links.append((number, target))
    return links


def test_the_pages_exist() -> None:
    assert README.is_file()
    names = {page.name for page in DOCS}
    # the topic docs the README sends a newcomer to, and the design the code cites
    for name in ("ARCHITECTURE.md", "DESIGN.md", "BENCHMARKS.md", "API.md", "MEMORY.md"):
        assert name in names, f"docs/{name} is missing"


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` to a missing file, or to a heading its page lacks."""
    broken = []
    for number, target in relative_links(page):
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        where = f"{page.name}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{where} (no heading #{fragment} in {linked.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_link_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: with `code`\n\n## Twice\n\n## Twice\n")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "x.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-with-code) [gone](missing.md) ![img](img/x.png)\n"
        "`[not a link](nowhere.md)` [site](https://example.com) [second](there.md#twice-1)\n"
        "```\n[in code](nowhere.md)\n```\n"
        "[no such heading](there.md#nowhere) [self](#nowhere-here)\n"
    )
    assert anchors(tmp_path / "there.md") == {"a-heading-with-code", "twice", "twice-1"}
    assert broken_links(page) == [
        "page.md:1: missing.md (no such file)",
        "page.md:6: there.md#nowhere (no heading #nowhere in there.md)",
        "page.md:6: #nowhere-here (no heading #nowhere-here in page.md)",
    ]


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size < README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to a doc under docs/"
    )


def test_readme_opens_with_a_command_to_run() -> None:
    lines = README.read_text().splitlines()[:FIRST_COMMAND_WITHIN_LINES]
    fenced, commands = False, []
    for line in lines:
        if FENCE.match(line):
            fenced = not fenced
        elif fenced and line.startswith("make "):
            commands.append(line)
    assert commands, f"no `make ...` line in a code block in README's first {len(lines)} lines"
    assert any(line.startswith("make run") for line in commands)


def readme_figures() -> list[dict[str, str]]:
    """The rows of README's table of headline figures, as {column: cell}."""
    text = README.read_text()
    section = text.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    return [
        dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")), strict=True))
        for row in rows[2:]
    ]


def test_readme_figures_are_in_benchmarks() -> None:
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    rows = readme_figures()
    assert 1 <= len(rows) <= 5, f"README has {len(rows)} headline figures (at most 5)"
    for row in rows:
        assert set(row) == {"figure", "value", "command", "machine, date"}, row
        command = row["command"].strip("`")
        assert command in benchmarks, f"{row['figure']}: `{command}` not in docs/BENCHMARKS.md"
        date = re.search(r"\d{4}-\d{2}-\d{2}", row["machine, date"])
        assert date and date.group() in benchmarks, f"{row['figure']}: no date of BENCHMARKS"
        for number in re.findall(r"\d+(?:\.\d+)?", row["value"]):
            assert number in benchmarks, f"{row['figure']}: {number} not in docs/BENCHMARKS.md"
