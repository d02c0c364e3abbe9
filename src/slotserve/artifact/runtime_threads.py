"""ExecuTorch's thread pool: one per process, sized explicitly, never resized under a bundle.

ExecuTorch 1.5's runtime has a single thread pool for the whole process (its Python API
offers only ``_threadpool_get_thread_count`` and ``_unsafe_reset_threadpool``; no program or
method takes its own), so a bundle's ``threads`` is a process setting, not a bundle's. This
module owns it. The first bundle loaded sizes the pool: its ``threads``, or ExecuTorch's own
size (every core) for 0. While any program loaded under that size is alive (held weakly), a
bundle that asks for another size is refused (`ThreadPoolConflict`) and one that asks for 0
runs at the held size (logged); once the last is gone, the next bundle sizes the pool anew.
It never touches torch's threads or the native kernels' (`slotserve.native.threads`).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from pathlib import Path

from slotserve.errors import ThreadPoolConflict

log = logging.getLogger("slotserve")

_lock = threading.Lock()
_holders: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
"""The programs loaded under the pool's size, each with its bundle's path."""
_size: int | None = None  # the size the holders run at
_default: int | None = None  # ExecuTorch's own size, read before the pool is first resized


def default_threads() -> int:
    """ExecuTorch's own pool size in this process (every core), as it was before any bundle
    resized it: what ``threads=0`` means when no bundle holds the pool."""
    global _default
    if _default is None:
        from executorch.extension.pybindings import portable_lib

        _default = int(portable_lib._threadpool_get_thread_count())
    return _default


def claim_threads(holder: object, threads: int, bundle: Path) -> int:
    """Run ``holder`` (a program of the bundle at ``bundle``, held weakly until it is
    collected) on the pool at ``threads`` (0: the held size, else every core), resizing the
    pool only while no other program holds it. Returns the size it runs at;
    `ThreadPoolConflict` when another live program holds another size."""
    global _size
    from executorch.extension.pybindings import portable_lib

    default = default_threads()
    with _lock:
        if _holders and threads and threads != _size:
            gc.collect()  # a program no longer reachable holds nothing
        if _holders and _size is not None:
            if threads and threads != _size:
                holder_path = next(iter(_holders.values()))
                raise ThreadPoolConflict(bundle, threads, _size, holder_path)
            if not threads and _size != default:
                log.info(
                    "%s runs ExecuTorch's thread pool at the %d threads a bundle still loaded "
                    "set (the pool is one per process)",
                    bundle,
                    _size,
                )
            _holders[holder] = str(bundle)
            return _size
        size = threads or default
        if portable_lib._threadpool_get_thread_count() != size:
            portable_lib._unsafe_reset_threadpool(size)
        _size = size
        _holders[holder] = str(bundle)
        return size


def held_threads() -> int | None:
    """The pool's size while a loaded program holds it, else None."""
    with _lock:
        return _size if _holders else None
