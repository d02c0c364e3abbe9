"""Shared fixtures: the bundled model (loaded once per session) and tiny random models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.native import Kernels, build_kernels
from slotserve.testing import write_tiny_gguf, write_tiny_hf_dir

DATA = Path(__file__).parent / "data"


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
