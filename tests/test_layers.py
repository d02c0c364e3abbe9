"""The layers of DESIGN.md: imports only go down, and every package imports on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "slotserve"

# Each top-level module or package of slotserve and its layer; a module may import only from
# its own package or from a strictly lower layer (docs/ARCHITECTURE.md draws the same map).
LAYERS: dict[str, int] = {
    "errors": 0,
    "info": 0,
    "tokenizer": 0,
    "memory": 0,
    "paths": 0,
    "native": 1,
    "kv": 2,
    "sampling": 2,
    "model": 3,
    "plan": 3,
    "artifact": 4,
    "executor": 5,
    "export": 5,
    "prefix": 5,
    "engine": 6,
    "runner": 7,
    "server": 8,
    "testing": 8,
    "bench": 9,  # above the server: the tool-call case uses the server's grammar and parsing
    "cli": 10,
}


def _part(path: Path) -> str:
    """The top-level module or package a source file belongs to."""
    relative = path.relative_to(SRC)
    return relative.parts[0].removesuffix(".py")


def _imported_parts(tree: ast.AST) -> set[str]:
    parts = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name == "slotserve":
                parts.add("slotserve")
            elif name.startswith("slotserve."):
                parts.add(name.split(".")[1])
    return parts


def _sources() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if p != SRC / "__init__.py"]


def test_every_module_has_a_layer() -> None:
    assert {_part(p) for p in _sources()} == set(LAYERS)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_only_go_down(path: Path) -> None:
    own = _part(path)
    upward = []
    for target in _imported_parts(ast.parse(path.read_text())):
        if target == "slotserve":
            upward.append("slotserve (the package root re-exports every layer)")
        elif target != own and LAYERS[target] >= LAYERS[own]:
            upward.append(f"{target} (layer {LAYERS[target]})")
    assert not upward, f"{own} (layer {LAYERS[own]}) imports {upward}"


def test_every_package_imports_first_on_its_own() -> None:
    """Each part imported first, in a fresh interpreter, must work: no import order hides
    a cycle."""
    processes = {
        part: subprocess.Popen(
            [sys.executable, "-c", f"import slotserve.{part}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for part in LAYERS
    }
    failures = {}
    for part, process in processes.items():
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            failures[part] = output.strip().splitlines()[-1:]
    assert not failures, failures
