"""The suite's own schedule (`tests/conftest.py`): every module it names exists, so a renamed
module cannot silently drop out of the long-first order."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_FIRST, QUIET_LAST

ROOT = Path(__file__).resolve().parent.parent


def test_every_long_module_named_exists() -> None:
    named = (*LONG_FIRST, *QUIET_LAST)
    missing = [path for path in named if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py names modules that are gone: {missing}"
    assert len(set(named)) == len(named)
