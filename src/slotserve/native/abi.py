"""The ABI check shared by the bindings: each C argument struct exports its size and field
offsets (``LAYOUT`` in ``csrc/common.h``), compared here with its ctypes mirror."""

from __future__ import annotations

import ctypes


def layout_mismatch(library: ctypes.CDLL, c_name: str, mirror: type[ctypes.Structure]) -> str:
    """Empty where ``mirror`` has the size and field offsets of the C struct ``c_name``;
    otherwise what differs."""
    fields = [name for name, *_ in mirror._fields_]
    capacity = 64  # more than any struct has; unwritten entries stay -1
    offsets = (ctypes.c_int64 * capacity)(*([-1] * capacity))
    function = getattr(library, f"{c_name}_layout")
    function.restype, function.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    size = function(offsets)
    written = [offset for offset in offsets if offset >= 0]
    problems = []
    if size != ctypes.sizeof(mirror):
        problems.append(f"size C {size} != ctypes {ctypes.sizeof(mirror)}")
    if len(written) != len(fields):
        problems.append(f"has {len(written)} fields, ctypes {len(fields)}")
    for name, offset in zip(fields, written, strict=False):
        ours = getattr(mirror, name).offset
        if ours != offset:
            problems.append(f"{name}: C offset {offset} != ctypes {ours}")
    return "; ".join(f"{c_name} {p}" for p in problems)
