"""The pytest plugin `slotserve.bench.llamacpp_suite` runs llama.cpp's server tests with
(``-p slotserve.bench.llamacpp_suite_plugin``): no hub downloads, nothing else changed.

- The suite's ``utils`` imports ``wget`` (for ``download_file``, which the tests run here
  never call); where it is not installed, a module whose ``download`` refuses stands in.
- Its session fixture ``load_server_presets`` starts every ``ServerPreset`` online once, to
  fetch their models from the hub; here it does nothing (`llamacpp_suite` maps the one
  preset it runs to the bundled model).
- A server's start may take up to ``$LLAMACPP_SUITE_START_TIMEOUT`` seconds (default
  `START_TIMEOUT`) instead of the suite's 60: on a busy machine slotserve's start
  (loading, then timing its largest step for the cancellation bound) can take longer.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pytest runs this plugin; slotserve itself does not need pytest
    import pytest

START_TIMEOUT = 300


def _refuse_download(url: str, out: str | None = None) -> str:
    raise RuntimeError(f"no downloads in slotserve's run of llama.cpp's suite: {url}")


def _stand_in_for_wget() -> None:
    """Stand in for ``wget`` before the suite's conftest imports ``utils``: pytest imports
    a ``-p`` plugin before it loads any conftest, so this runs at the plugin's import."""
    if importlib.util.find_spec("wget") is None:
        stand_in = types.ModuleType("wget")
        stand_in.download = _refuse_download  # type: ignore[attr-defined]
        sys.modules["wget"] = stand_in


_stand_in_for_wget()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Switch off ``ServerPreset.load_all`` (the suite's conftest has imported ``utils``)."""
    utils = sys.modules.get("utils")
    if utils is not None:
        utils.ServerPreset.load_all = staticmethod(lambda: None)
        timeout = int(os.environ.get("LLAMACPP_SUITE_START_TIMEOUT", START_TIMEOUT))
        utils.ServerProcess.start.__defaults__ = (timeout,)
