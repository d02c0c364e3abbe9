"""The suite's own schedule (`tests/conftest.py`): every module it names exists, so a renamed
module cannot silently drop out of the long-first order."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_FIRST

ROOT = Path(__file__).resolve().parent.parent


def test_every_long_module_named_exists() -> None:
    missing = [path for path in LONG_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py's LONG_FIRST names modules that are gone: {missing}"
    assert len(set(LONG_FIRST)) == len(LONG_FIRST)
