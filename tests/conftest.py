"""Shared fixtures: the bundled model (loaded once per session) and tiny random models."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.native import Kernels, build_kernels
from slotserve.testing import write_tiny_gguf, write_tiny_hf_dir

DATA = Path(__file__).parent / "data"

# Session fixtures that export a bundle (tens of seconds to minutes of one core each).
EXPORTING_FIXTURES = ("q41", "bundled_fp32_export", "tiny_bundle")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs ``-n auto --dist loadgroup``) each worker gets
    its own share of the cores: the kernels size their threads to the process's cores
    (`slotserve.native.threads.process_cores`), so two workers that each start a thread
    a core would oversubscribe them and spend the time waiting on each other."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker is None or count is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < int(count):
        return
    mine = set(cores[int(worker.removeprefix("gw")) :: int(count)])
    os.sched_setaffinity(0, mine)
    import torch

    torch.set_num_threads(len(mine))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``loadgroup``: a module goes to one worker whole (its
    module fixtures, servers and engines, are built once), and the modules that share an
    exported bundle (``q41``, the bundled fp32 export) share a group, so each export runs in
    one worker only. The groups with an export run first: they are the longest, and a
    long group started last would leave the other workers idle at the end."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    first: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for module, members in modules.items():
        used = {name for item in members for name in getattr(item, "fixturenames", ())}
        export = next((name for name in EXPORTING_FIXTURES if name in used), None)
        group = module if export in (None, "tiny_bundle") else export
        for item in members:
            item.add_marker(pytest.mark.xdist_group(group))
        (first if export else rest).extend(members)
    items[:] = first + rest


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
def gemma3() -> ss.Model:
    """Gemma 3 270M (Q4_K_M) on its own blocks; ``make test`` installs it."""
    from slotserve.artifact.gemma3 import GEMMA3_PACKAGE, INSTALL_HINT

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip(f"Gemma 3 270M is not installed: {INSTALL_HINT}")
    return ss.load("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / "llamacpp_greedy.json").read_text())
    return data


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    kinds = ("llama", "llama3-rope", "qwen2", "qwen3", "mistral", "mixed")
    return {kind: write_tiny_hf_dir(root / kind, kind) for kind in kinds}


@pytest.fixture(scope="session")
def tiny(tiny_dirs: dict[str, Path]) -> ss.Model:
    return ss.load(tiny_dirs["llama"])


@pytest.fixture(scope="session")
def tiny_bundle(tiny: ss.Model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama exported as an fp32 XNNPACK bundle (about 20 s, once per session)."""
    from slotserve.export import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny-fp32"
    export_bundle(tiny, out, ExportOptions(quant="fp32"))
    return out


@pytest.fixture(scope="session")
def q41(tmp_path_factory: pytest.TempPathFactory) -> tuple[ss.Model, Path]:
    """A tiny Q4_1 GGUF's fp32 model (the eager reference) and its 8da4w bundle, exported as
    `slotserve export` does: from the model loaded with its blocks (about 40 s, once per
    session; also the "another model" whose weights a tiny bundle must refuse)."""
    from slotserve.export import ExportOptions, export_bundle, load_for_export

    root = tmp_path_factory.mktemp("q41")
    gguf = write_tiny_gguf(root / "tiny-q4_1.gguf", "llama", "Q4_1")
    blocks = load_for_export(gguf, progress=False)
    export_bundle(blocks, root / "bundle", ExportOptions(quant="8da4w", max_tokens=64))
    return ss.load(gguf, weights="fp32", progress=False), root / "bundle"
