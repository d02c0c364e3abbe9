"""Shared fixtures: the bundled model (loaded once per session), tiny random models, and the
bundles the suite exports beside its tests."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.locks import check_lock_order, clear_lock_order_violations, lock_order_violations
from slotserve.native import Kernels, build_kernels
from slotserve.testing import write_tiny_gguf, write_tiny_hf_dir
from tests.exports import BUNDLED_FP32, Export, ExportFarm, write_tied_llama

DATA = Path(__file__).parent / "data"

# Every test checks the lock order (`slotserve.locks`), servers it starts too (the variable).
os.environ["SLOTSERVE_LOCK_CHECK"] = "1"
check_lock_order(True)


@pytest.fixture(autouse=True)
def lock_order() -> Iterator[None]:
    """A test fails if any thread took locks against the order while it ran, even where
    the `LockOrderError` was caught and logged (a writer thread, a step)."""
    clear_lock_order_violations()
    yield
    assert not lock_order_violations(), lock_order_violations()


@pytest.fixture(scope="session", autouse=True)
def kernels() -> Kernels:
    """The compiled kernels, built once, as `slotserve.load` builds them (a test that
    multiplies GGUF blocks by hand needs them built first)."""
    return build_kernels()


@pytest.fixture(scope="session")
def bundled() -> ss.Model:
    return ss.load("bundled", weights="fp32", progress=False)  # the dequantised reference


@pytest.fixture(scope="session")
def bundled_blocks() -> ss.Model:
    """The bundled model as its GGUF file's blocks (what ``load`` gives by default)."""
    model = ss.load("bundled", weights="gguf", progress=False)
    assert model.halves.kind == "block"
    return model


@pytest.fixture(scope="session")
def gemma3_installed() -> None:
    """Skips a test where Gemma 3 270M's packages are missing (``make test`` installs them;
    a user's `make run` need not)."""
    from slotserve.artifact.gemma3 import GEMMA3_PACKAGE, INSTALL_HINT

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip(f"Gemma 3 270M is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="session")
def gemma3(gemma3_installed: None) -> ss.Model:
    """Gemma 3 270M (Q4_K_M) on its own blocks; ``make test`` installs it."""
    return ss.load("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / "llamacpp_greedy.json").read_text())
    return data


def xdist_worker() -> str | None:
    """The pytest-xdist worker this process is ("gw0", ...), None when run alone."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def run_directory(factory: pytest.TempPathFactory, name: str, write: Callable[[Path], Any]) -> Path:
    """A directory that ``write`` fills, once for the whole test run: the session's own when
    run alone; under pytest-xdist one in the run's common temporary directory (above each
    worker's), so that every worker reads the same paths (a bundle records the path of the
    model it was exported from). Each worker that finds it missing writes its own copy
    apart and renames it into place; the first rename wins, and the files are the same."""
    if xdist_worker() is None:
        path = factory.mktemp(name)
        write(path)
        return path
    shared = factory.getbasetemp().parent / name
    if not shared.exists():
        mine = factory.mktemp(name)
        write(mine)
        with contextlib.suppress(OSError):  # another worker's copy is in place
            mine.rename(shared)
    return shared


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    kinds = ("llama", "llama3-rope", "qwen2", "qwen3", "mistral", "mixed")
    root = run_directory(
        tmp_path_factory, "tiny", lambda r: [write_tiny_hf_dir(r / kind, kind) for kind in kinds]
    )
    return {kind: root / kind for kind in kinds}


@pytest.fixture(scope="session")
def tiny(tiny_dirs: dict[str, Path]) -> ss.Model:
    return ss.load(tiny_dirs["llama"])


# -- the suite's bundles: exported in child processes while the other tests run (tests/exports.py)

# What each fixture waits for: the farm's exports it reads. A test that asks for one of these
# by `request.getfixturevalue` names it in an `exports` mark instead (the session can only
# submit what it sees a test will need).
EXPORTS = {
    "tiny_bundle": ("tiny-fp32",),
    "twin_bundle": ("twin-fp32",),
    "q41": ("q41-8da4w",),
    "tied_bundles": ("tied-fp32", "tied-8da4w"),
    "bundled_fp32_export": ("bundled-fp32",),
}


def exports_of(item: pytest.Item) -> list[str]:
    fixtures = list(getattr(item, "fixturenames", ()))
    fixtures += [name for mark in item.iter_markers("exports") for name in mark.args]
    return [export for fixture in fixtures for export in EXPORTS.get(fixture, ())]


# The modules that run longest (real models end to end, servers, the AArch64 cross-build
# where it is not cached), longest first as `make test` times them: they start the run, so
# the two workers (pytest-xdist keeps this order under --no-loadscope-reorder) end it
# together, with the short modules filling in, rather than one worker ending it alone in a
# long module. Export readers keep this order among themselves.
LONG_FIRST = (
    "tests/speculative/test_exactness.py",
    "tests/speculative/test_draft_model.py",
    "tests/test_plan_serve.py",
    "tests/models/test_serve_models.py",
    "tests/artifact/test_gguf_reader.py",
    "tests/server/test_bundled_tool_calls.py",
    "tests/server/test_tool_calling.py",
    "tests/test_plan.py",
    "tests/engine/test_prefix_gemma3.py",
    "tests/server/test_prefix_store_server.py",
    "tests/artifact/test_gguf_parity.py",
    "tests/test_bench_models.py",
    "tests/native/test_aarch64.py",
    "tests/server/test_cut_tool_calls.py",
    "tests/server/test_http.py",
    "tests/test_bench_memory.py",
    "tests/test_bench.py",
)


# The modules that hold a server to a latency bound while it works (/health within a second
# under a soak, a signal's exit within two): they run at the end, after the export readers,
# when the farm's exports, ruff and mypy no longer share the two cores with the workers.
# At the start of a run, beside all of those, a bound promised for a loaded server's own
# work fails for what the test run itself adds.
QUIET_LAST = (
    "tests/reliability/test_soak_everything.py",
    "tests/reliability/test_server_shutdown.py",
    "tests/server/test_grammar_bounds.py",
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The imports' and the collection's objects, frozen out of the garbage collector: they
    live as long as the run, and a full collection (a model set's unload, a bundle's close)
    then walks only what the tests made, as `slotserve serve` freezes what it holds before
    its models."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long modules first (`LONG_FIRST`), then the rest; the modules that read an
    export next, whole and in their order, so the farm exports while the others run; the
    latency-bound modules last (`QUIET_LAST`)."""
    late = {item.module for item in items if exports_of(item)}  # type: ignore[attr-defined]
    rank = {path: index for index, path in enumerate(LONG_FIRST)}
    quiet = {path: index for index, path in enumerate(QUIET_LAST)}

    def place(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        if path in quiet:
            return 2, quiet[path]
        return int(getattr(item, "module", None) in late), rank.get(path, len(rank))

    items.sort(key=place)


@pytest.fixture(scope="session")
def export_farm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExportFarm]:
    """Every export the session's tests read, submitted in the order they will be read.
    Under pytest-xdist the first worker to start a test runs them into a directory all
    workers share (the run's base temporary directory, above each worker's own), and the
    others wait for them there (`tests.exports.ExportFarm`)."""
    if xdist_worker() is None:
        farm = ExportFarm(tmp_path_factory.mktemp("exports"))
    else:
        root = tmp_path_factory.getbasetemp().parent / "exports"
        root.mkdir(exist_ok=True)
        try:  # mkdir is atomic: one worker makes it, and owns the farm
            (root / "owner").mkdir()
            owner = True
        except FileExistsError:
            owner = False
        farm = ExportFarm(root, owner=owner, shared=True)
    # The exports' inputs: written by the farm's owner, read at the same paths by all.
    inputs = farm.root / "inputs"
    needed = dict.fromkeys(name for item in request.session.items for name in exports_of(item))
    for name in needed:
        farm.submit(name, _export(name, inputs, request, write=farm.owner))
    farm.submitted()
    yield farm
    farm.stop()


def _export(name: str, inputs: Path, request: pytest.FixtureRequest, *, write: bool) -> Export:
    """Export ``name``'s job, its input files written to ``inputs`` when ``write``."""
    if name in ("tiny-fp32", "twin-fp32"):  # the twin: the same weights, another pairing id
        return Export(request.getfixturevalue("tiny_dirs")["llama"], {"quant": "fp32"})
    if name == "q41-8da4w":  # exported as `slotserve export` does: from the GGUF's blocks
        # Two layers, not the tiny Llama's four: 7 methods to lower, not 11 (each ~6 s).
        gguf = inputs / "tiny-q4_1.gguf"
        if write:
            inputs.mkdir(exist_ok=True)
            write_tiny_gguf(gguf, "llama", "Q4_1", layers=2)
        return Export(gguf, {"quant": "8da4w", "max_tokens": 64}, blocks=True)
    if name.startswith("tied-"):
        tied = inputs / "tied"
        if write and not tied.exists():
            write_tied_llama(tied)
        return Export(tied, {"quant": name.removeprefix("tied-"), "max_tokens": 64})
    assert name == "bundled-fp32", name
    return Export("bundled", BUNDLED_FP32, load={"weights": "fp32"})


@pytest.fixture(scope="session", autouse=True)
def _exports_start_with_the_session(request: pytest.FixtureRequest) -> None:
    if any(exports_of(item) for item in request.session.items):
        request.getfixturevalue("export_farm")


@pytest.fixture(scope="session")
def tiny_bundle(export_farm: ExportFarm) -> Path:
    """The tiny Llama (`tiny`) as an fp32 XNNPACK bundle."""
    return export_farm.result("tiny-fp32")


@pytest.fixture(scope="session")
def twin_bundle(export_farm: ExportFarm) -> Path:
    """The tiny Llama exported again: the same weight names, another pairing id."""
    return export_farm.result("twin-fp32")


@pytest.fixture(scope="session")
def q41(export_farm: ExportFarm) -> tuple[ss.Model, Path]:
    """A tiny Q4_1 GGUF's fp32 model (the eager reference) and its 8da4w bundle, exported as
    `slotserve export` does, from the model loaded with its blocks (also the "another model"
    whose weights a tiny bundle must refuse)."""
    bundle = export_farm.result("q41-8da4w")
    return ss.load(export_farm.source("q41-8da4w"), weights="fp32", progress=False), bundle


@pytest.fixture(scope="session")
def tied_bundles(export_farm: ExportFarm) -> dict[str, Path]:
    """The tied-embedding model (`write_tied_llama`) as an fp32 and an 8da4w bundle."""
    return {quant: export_farm.result(f"tied-{quant}") for quant in ("fp32", "8da4w")}


@pytest.fixture(scope="session")
def bundled_fp32_export(export_farm: ExportFarm) -> Path:
    """The bundled model as an fp32 bundle (`BUNDLED_FP32`), about three minutes of a core."""
    return export_farm.result("bundled-fp32")
