"""The layers of docs/DESIGN.md: imports only go down, no module imports itself back through
others (no circle), and every package imports on its own."""

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
    "memory": 1,  # a leaf: imports only the errors
    "paths": 0,
    "locks": 0,
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


def _module_name(path: Path) -> str:
    """``slotserve.a.b`` for ``src/slotserve/a/b.py`` (a package for its ``__init__.py``)."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Each slotserve module and the slotserve modules it imports: every import statement,
    those under ``TYPE_CHECKING`` and inside functions included (a circle of lazy imports is
    still two modules that need each other). ``from package import name`` counts the
    submodule ``name`` where there is one, else the package."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.startswith("slotserve")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                package = node.module
                if package.split(".")[0] == "slotserve":
                    for alias in node.names:
                        full = f"{package}.{alias.name}"
                        targets.add(full if full in modules else owner(package))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_circles_between_modules() -> None:
    """Two modules that import each other (even one only for its types) are one job split
    badly, or share words that belong in a third module both can import."""
    assert not _circles(_module_graph())


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


# Run in one fresh interpreter: it imports the heavy third-party libraries once, then forks a
# child per part that imports ``slotserve.<part>`` first (no slotserve module is loaded
# before the fork), so each part is still imported first on its own, without paying torch's
# import twenty times (40 s of the suite before).
FORK_EACH_PART = """
import importlib, os, sys, traceback
for heavy in ("torch", "numpy", "fastapi", "uvicorn", "pydantic", "jinja2", "rich", "httpx"):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
assert not [m for m in sys.modules if m.split(".")[0] == "slotserve"], "slotserve preloaded"
failures = {}
for part in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module("slotserve." + part)
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status:
        failures[part] = message or f"exit status {status}"
print(failures)
sys.exit(1 if failures else 0)
"""


def test_every_package_imports_first_on_its_own() -> None:
    """Each part imported first, in an interpreter that has loaded no slotserve module,
    must work: no import order hides a cycle."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_EACH_PART, *LAYERS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
