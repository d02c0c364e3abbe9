"""Every kernel call takes one struct, mirrored by a ctypes.Structure: their sizes and field
offsets agree (the C side exports them), and a mirror that drifts is caught."""

from __future__ import annotations

import ctypes

import pytest

from slotserve.native import build
from slotserve.native.abi import layout_mismatch
from slotserve.native.attention import AttendArgs
from slotserve.native.blocks import STRUCTS

MIRRORS = [("attention", "attend_args", AttendArgs)] + [
    ("blocks", name, mirror) for name, mirror in STRUCTS.items()
]


@pytest.mark.parametrize(("kernel", "c_name", "mirror"), MIRRORS)
def test_ctypes_mirrors_the_c_struct(
    kernel: str, c_name: str, mirror: type[ctypes.Structure]
) -> None:
    assert layout_mismatch(build.load(kernel), c_name, mirror) == ""


def test_a_drifted_mirror_is_named() -> None:
    class Narrowed(ctypes.Structure):  # `rows` as 32 bits: it moves from 16 to 12
        _fields_ = [("blocks", ctypes.c_void_p), ("kind", ctypes.c_int32), ("rows", ctypes.c_int32)]

    found = layout_mismatch(build.load("blocks"), "matrix", Narrowed)
    assert "matrix rows: C offset 16 != ctypes 12" in found

    class Missing(ctypes.Structure):
        _fields_ = [("blocks", ctypes.c_void_p), ("kind", ctypes.c_int64)]

    assert "size C 32 != ctypes 16" in layout_mismatch(build.load("blocks"), "matrix", Missing)
