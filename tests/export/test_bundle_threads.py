"""ExecuTorch's thread pool is one per process (`slotserve.artifact.runtime_threads`): a
second bundle loaded in the process never resizes it under the first. A conflicting size is
refused with `ThreadPoolConflict` naming both sizes, the bundle that holds the pool and the
fix; an agreeing one (or 0) runs at the held size; once the first is gone, any size is taken.

Each test loads the real tiny bundle twice (the second from a copy, so the paths differ).
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.artifact.program import ProgramHalves
from slotserve.artifact.runtime_threads import default_threads, held_threads
from slotserve.errors import ThreadPoolConflict


@pytest.fixture
def pool() -> Iterator[Any]:
    """ExecuTorch's pool, held by no program when the test starts, and put back to
    ExecuTorch's own size after it."""
    from executorch.extension.pybindings import portable_lib

    gc.collect()
    assert held_threads() is None, "a program loaded by an earlier test is still alive"
    yield portable_lib
    gc.collect()
    if held_threads() is None:
        portable_lib._unsafe_reset_threadpool(default_threads())


@pytest.fixture
def second(tiny_bundle: Path, tmp_path: Path) -> Path:
    """Another bundle directory: a copy of the tiny bundle."""
    return Path(shutil.copytree(tiny_bundle, tmp_path / "second"))


def threads_of(model: ss.Model) -> int:
    assert isinstance(model.halves, ProgramHalves)
    return model.halves.threads


def test_a_second_bundle_cannot_resize_the_pool_under_the_first(
    tiny_bundle: Path, second: Path, pool: Any
) -> None:
    first = ss.load(tiny_bundle, bundle_threads=1, progress=False)
    with pytest.raises(ThreadPoolConflict) as raised:
        ss.load(second, bundle_threads=2, progress=False)
    error = raised.value
    assert (error.path, error.requested, error.held, error.holder) == (
        str(second),
        2,
        1,
        str(tiny_bundle),
    )
    assert f"asks ExecuTorch's thread pool for 2 threads, but {tiny_bundle}" in str(error)
    assert "load every bundle with threads=1 (serve --threads 1)" in str(error)
    assert threads_of(first) == pool._threadpool_get_thread_count() == 1


def test_a_bundle_on_the_default_pool_is_not_resized_by_a_second(
    tiny_bundle: Path, second: Path, pool: Any
) -> None:
    """The first bundle asks for nothing (the manifest's 0): it runs on every core, and a
    second bundle's explicit size would change its threads, so it is refused."""
    first = ss.load(tiny_bundle, progress=False)
    everyone = default_threads()
    other = 1 if everyone != 1 else 2
    with pytest.raises(ThreadPoolConflict) as raised:
        ss.load(second, bundle_threads=other, progress=False)
    assert (raised.value.requested, raised.value.held) == (other, everyone)
    assert threads_of(first) == pool._threadpool_get_thread_count() == everyone


def test_bundles_that_agree_share_the_pool(tiny_bundle: Path, second: Path, pool: Any) -> None:
    first = ss.load(tiny_bundle, bundle_threads=1, progress=False)
    same = ss.load(second, bundle_threads=1, progress=False)
    unset = ss.load(second, progress=False)  # 0: the size the pool is held at
    assert [threads_of(m) for m in (first, same, unset)] == [1, 1, 1]
    assert pool._threadpool_get_thread_count() == 1


def test_once_the_first_is_gone_another_size_is_taken(
    tiny_bundle: Path, second: Path, pool: Any
) -> None:
    first = ss.load(tiny_bundle, bundle_threads=1, progress=False)
    assert held_threads() == 1
    del first
    gc.collect()
    assert held_threads() is None
    later = ss.load(second, bundle_threads=2, progress=False)
    assert threads_of(later) == pool._threadpool_get_thread_count() == 2
