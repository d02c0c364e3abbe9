"""Comments state what and why (issue 51, item 2): no comment or docstring in ``src/`` outside
``bench/`` and ``cli/`` names a CPU model or carries a measured timing or figure. Those rot
with the next change; they belong in commit messages and ``docs/BENCHMARKS.md``.

Python comments and docstrings (every bare string statement) and C comments are scanned;
code and its string literals are not. A figure broken over two comment lines is still
found. `ALLOWED` lists the numbers in comments that are not measurements, each with why.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
SKIPPED = ("slotserve/bench", "slotserve/cli")  # they report measurements by design

CPU_MODEL = re.compile(
    r"\b(?:EPYC|Epyc|Xeon|XEON|Zen|Sapphire|Emerald Rapids|Granite Rapids|Genoa|Milan|Bergamo"
    r"|Ryzen|Threadripper|Graviton\d*|Neoverse|Ampere Altra|Apple M\d|Core i[3579]"
    r"|Cortex-A\d+|Skylake|Cascade ?Lake|Ice ?Lake|Alder ?Lake|Raptor ?Lake)\b"
)
# A number, not part of a name or a longer number, and not a quoted or assigned example of
# a byte count as a user writes one (``"1GiB"``, ``weights=600MiB``).
_NUMBER = r"(?<![\w.\"'=])\d+(?:[.,]\d+)*"
FIGURES = {
    "timing or size": re.compile(
        _NUMBER + r"(?:\s?(?:ms|µs|us|ns|tok/s|tokens/s|t/s|[KMG]i?B/s|[KMG]i?B)"
        r"|\s(?:s|secs?|seconds?|min|minutes?))(?![\w/])"
    ),
    "ratio": re.compile(
        _NUMBER + r"(?:[x×](?![\w(])"
        r"|\s[x×]\s(?:faster|slower|quicker|as fast|less|more|fewer|smaller|larger))"
    ),
    "percentage": re.compile(_NUMBER + r"\s?%"),
    "before -> after": re.compile(_NUMBER + r"\s*(?:->|→)\s*" + _NUMBER),
}
# (file under src/, the text matched): why it is not a measurement.
ALLOWED: dict[tuple[str, str], str] = {
    ("slotserve/native/csrc/quants.h", "128 s"): "algebra: 128 times s, a Q8 block's d Σq",
    ("slotserve/native/csrc/quants.h", "16 s"): "algebra: 16 times s, a Q8 block's d Σq",
}


def _python_comments(source: str) -> dict[int, str]:
    """Line number -> the comment and docstring text on it."""
    lines = source.split("\n")
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            end = node.end_lineno or node.lineno
            for number in range(node.lineno, end + 1):
                found[number] = lines[number - 1]
    return found


def _c_comments(source: str) -> dict[int, str]:
    """Line number -> the ``/* */`` and ``//`` comment text on it (string literals skipped)."""
    found: dict[int, str] = {}
    for match in re.finditer(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"", source, re.S):
        if match.group().startswith('"'):
            continue
        first = source.count("\n", 0, match.start()) + 1
        for offset, text in enumerate(match.group().split("\n")):
            found[first + offset] = found.get(first + offset, "") + " " + text
    return found


def offences_in(comments: dict[int, str]) -> list[tuple[int, str, str]]:
    """(line, kind, text) of each CPU model or figure in ``comments``. Each line is read
    with the next comment line's text after it, so a figure broken over the two counts on
    the line where it starts."""
    found = []
    for number, text in sorted(comments.items()):
        following = re.sub(r"^\s*(?:\*|#|//)?\s*", "", comments.get(number + 1, ""))
        joined = f"{text} {following}"
        for kind, pattern in (("CPU model", CPU_MODEL), *FIGURES.items()):
            for match in pattern.finditer(joined):
                if match.start() < len(text):
                    found.append((number, kind, re.sub(r"\s+", " ", match.group())))
    return found


def offences(root: Path) -> list[str]:
    """``file:line: kind 'text'`` for each CPU model or figure in the comments under
    ``root`` (a ``src/`` directory) that `ALLOWED` does not list."""
    report = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(SKIPPED) or path.suffix not in (".py", ".c", ".h"):
            continue
        source = path.read_text(encoding="utf-8")
        comments = _python_comments(source) if path.suffix == ".py" else _c_comments(source)
        for number, kind, text in offences_in(comments):
            if (relative, text) not in ALLOWED:
                report.append(f"{relative}:{number}: {kind} {text!r}")
    return report


def test_no_comment_names_a_cpu_or_carries_a_measured_figure() -> None:
    found = offences(SRC)
    assert not found, (
        "comments state what and why; move figures and machines to the commit message or "
        "docs/BENCHMARKS.md (or, for a number that is an invariant, add it to ALLOWED with "
        "the reason):\n" + "\n".join(found)
    )


def test_every_allowed_entry_is_still_needed() -> None:
    """An entry whose text is gone from its file is dropped, so the list stays short."""
    stale = []
    for relative, text in ALLOWED:
        path = SRC / relative
        source = path.read_text(encoding="utf-8")
        comments = _python_comments(source) if path.suffix == ".py" else _c_comments(source)
        if not any(found == text for _, _, found in offences_in(comments)):
            stale.append(f"{relative}: {text!r}")
    assert not stale, "ALLOWED entries that match nothing any more:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "comment",
    [
        "# a step took 3.2 ms at 8 rows",
        "# served 41 tok/s on two cores",
        "# 1.7x faster than rows one by one",
        "# 2× the cost of one row",
        "# the suite ran for 803 s",
        "# 0.27 us here, 8.7 us as torch ops",
        "# a 540 MB entry hashed",
        "# measured on the 2-core AMD EPYC",
        "# a Xeon with AVX-512",
        "# Zen 4 takes the 512-bit path",
        "# Q4_K 44.0 -> 30.2 at 1 row",
        "# which is 4% of a decode step",
    ],
)
def test_the_patterns_find_figures_and_machines(comment: str) -> None:
    assert offences_in(_python_comments(comment + "\n"))


def test_a_figure_broken_over_two_comment_lines_counts_on_its_first() -> None:
    c_source = "/* Gemma 3's head of 168\n * MB took longer */\n"
    assert [line for line, _, _ in offences_in(_c_comments(c_source))] == [1]
    py_source = '"""a step of 9.4\nms at one row"""\n'
    assert [line for line, _, _ in offences_in(_python_comments(py_source))] == [1]


@pytest.mark.parametrize(
    "comment",
    [
        "# a [576 x 1536] product",
        "# 4 x (ql [4][t][4], qh [4][t][4])",
        "# its own 400s name the message",
        '# bytes or ``"256MiB"``',
        '# ``"runtime=300MiB,weights=100MiB"``',
        "# blocks of 32 values, 34 bytes each",
        "# bits 16h + 4c + i of row n",
        "# Q5_1 for Q5_K, sums of 16 values",
    ],
)
def test_the_patterns_leave_invariants_and_examples_alone(comment: str) -> None:
    assert not offences_in(_python_comments(comment + "\n"))


def test_code_and_its_strings_are_not_scanned() -> None:
    source = 'RATE = "41 tok/s"  # the key\nprintf("3.2 ms");\n'
    assert not offences_in(_python_comments(source.split("\n")[0] + "\n"))
    assert not offences_in(_c_comments(source.split("\n")[1] + "\n"))
