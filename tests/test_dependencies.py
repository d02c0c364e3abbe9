"""pyproject.toml declares what the code imports: every third-party module that a source file
imports comes from a declared distribution, and one imported when its module loads (not
inside a function, where an optional feature imports it) from a required one."""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "slotserve"

# Imported by an optional feature that says what to install when it is missing, and not
# installable from a plain requirement: llama.cpp's Python binding is built from its sdist
# for this CPU by `make bench-deps` (slotserve.bench.baselines skips without it).
BUILT_APART = {"llama_cpp": "llama-cpp-python"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], set[str]]:
    """The required distributions, and every declared one (extras included)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {_normal(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in requirements}

    required = names(project["dependencies"])
    extras = set().union(*(names(r) for r in project["optional-dependencies"].values()))
    return required, required | extras


def _third_party_imports() -> dict[str, dict[str, bool]]:
    """Each third-party top-level module imported in src/, and for each importing file
    whether it imports it when the file loads (a statement of the module's own body)."""
    found: dict[str, dict[str, bool]] = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        at_load = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "slotserve" or top in sys.stdlib_module_names:
                    continue
                where = str(path.relative_to(SRC))
                files = found.setdefault(top, {})
                files[where] = files.get(where, False) or id(node) in at_load
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    """Each installed top-level module's distributions (read once: it scans every
    installed distribution's file list)."""
    return packages_distributions()


def _distributions(module: str) -> set[str]:
    if module in BUILT_APART:
        return {_normal(BUILT_APART[module])}
    return {_normal(d) for d in _installed().get(module, [])}


def test_every_import_is_declared() -> None:
    _, declared = _declared()
    undeclared = {
        module: sorted(files)
        for module, files in _third_party_imports().items()
        if module not in BUILT_APART and not _distributions(module) & declared
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_what_loads_with_a_module_is_required() -> None:
    required, _ = _declared()
    optional_at_load = {
        module: sorted(f for f, at_load in files.items() if at_load)
        for module, files in _third_party_imports().items()
        if any(files.values()) and not _distributions(module) & required
    }
    assert not optional_at_load, (
        f"imported when these modules load, but only an extra declares it: {optional_at_load}"
    )


def test_the_check_sees_imports() -> None:
    """The scan finds what the server and the benches import, where they import it."""
    imports = _third_party_imports()
    assert imports["httpx"]["bench/processes.py"] is True
    assert imports["openai"]["bench/servers.py"] is False  # inside the function that needs it
    assert "torch" in imports and "fastapi" in imports
