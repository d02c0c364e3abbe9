"""One table per block type (issue 51, item 7): `slotserve.native.blocks.BLOCK_TYPES` is the
source of a weight type's facts (code, block size in values and bytes, the kernel's layout
segments); this checks ``csrc/quants.h``'s enum and tables, and gguf-py's, against it.

quants.h is read as text (no compiler): its ``KIND_*`` enum, ``#define``s, the switches of
``weight_row_bytes``, ``block_bytes``, ``scales_at`` and ``act_format``, and the arrays of
``k_segments``.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import gguf
import pytest

from slotserve.model import gguf_linear
from slotserve.native import blocks
from slotserve.native.blocks import BLOCK_TYPES, FIFTH_BITS, BlockType

QUANTS_H = Path(blocks.__file__).parent / "csrc" / "quants.h"
SOURCE = QUANTS_H.read_text(encoding="utf-8")
CODE = re.sub(r"/\*.*?\*/|//[^\n]*", " ", SOURCE, flags=re.S)  # comments out
BY_NAME = {t.name: t for t in BLOCK_TYPES}


def _function_body(name: str) -> str:
    """The text of C function ``name``'s body in quants.h."""
    start = re.search(rf"\b{name}\([^)]*\)[^{{;]*\{{", CODE)
    assert start, f"quants.h has no function {name}"
    depth, at = 1, start.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(CODE[at], 0)
        at += 1
    return CODE[start.end() : at - 1]


def _switch(name: str) -> dict[str, str]:
    """Type name -> the expression function ``name``'s switch returns for it. Every type
    must be named by a case (the one a ``default`` serves too)."""
    returns: dict[str, str] = {}
    labels = r"((?:\s*(?:case\s+KIND_\w+|default)\s*:)+)\s*return\s+([^;]+);"
    for match in re.finditer(labels, _function_body(name)):
        for kind in re.findall(r"KIND_(\w+)", match.group(1)):
            assert kind not in returns, f"{name} names {kind} twice"
            returns[kind] = " ".join(match.group(2).split())
    return returns


def _define(name: str) -> int:
    match = re.search(rf"^#define\s+{name}\s+(\d+)\b", CODE, re.M)
    assert match, f"quants.h has no #define {name}"
    return int(match.group(1))


def test_the_enum_is_the_tables_codes() -> None:
    enum = re.search(r"enum\s*\{([^}]*KIND_[^}]*)\}", CODE)
    assert enum
    codes = {name: int(code) for name, code in re.findall(r"KIND_(\w+)\s*=\s*(\d+)", enum[1])}
    assert codes == {t.name: t.code for t in BLOCK_TYPES}
    assert codes == blocks.KIND_CODES


def test_codes_are_distinct_and_dense() -> None:
    """The kernel's switches default to the last type: a code outside 0..n-1 would be it."""
    assert sorted(t.code for t in BLOCK_TYPES) == list(range(len(BLOCK_TYPES)))


def test_the_defines_are_the_pythons() -> None:
    assert _define("BLOCK") == blocks.BLOCK
    assert _define("SUPER") == blocks.SUPER
    assert _define("GROUP") == blocks.GROUP
    assert {t.values for t in BLOCK_TYPES} == {blocks.BLOCK, blocks.SUPER}


def test_weight_row_bytes_is_the_tables_block_sizes() -> None:
    sizes = {"BLOCK": blocks.BLOCK, "SUPER": blocks.SUPER}
    found = {}
    for kind, expression in _switch("weight_row_bytes").items():
        match = re.fullmatch(r"k / (BLOCK|SUPER) \* (\d+)", expression)
        assert match, f"weight_row_bytes returns {expression!r} for {kind}"
        found[kind] = (sizes[match[1]], int(match[2]))
    assert found == blocks.BLOCK_SIZES


def test_block_bytes_is_the_tables_for_the_grouped_block_types() -> None:
    found = {kind: int(value) for kind, value in _switch("block_bytes").items()}
    assert found == {t.name: t.size for t in BLOCK_TYPES if t.values == blocks.BLOCK}


def _bytes_before_scales(t: BlockType) -> int:
    """Bytes a row has in a group block before its d (the segment at byte 0)."""
    at = 0
    for start, end, _ in t.segments:
        if start == 0:
            return at
        at += end - start
    raise AssertionError(f"{t.name} has no segment at byte 0")


def test_scales_at_follows_the_tables_segments() -> None:
    found = {}
    for kind, expression in _switch("scales_at").items():
        match = re.fullmatch(r"(\d+) \* t", expression)
        assert match, f"scales_at returns {expression!r} for {kind}"
        found[kind] = int(match[1])
    small = [t for t in BLOCK_TYPES if t.values == blocks.BLOCK]
    assert found == {t.name: _bytes_before_scales(t) for t in small}


def test_act_format_takes_q8_k_for_the_super_block_types() -> None:
    expected = {t.name: "ACT_Q8_K" if t.values == blocks.SUPER else "ACT_Q8" for t in BLOCK_TYPES}
    assert _switch("act_format") == expected


def test_k_segments_are_the_tables() -> None:
    body = _function_body("k_segments")
    arrays = {}
    for name, rows in re.findall(r"static const int (\w+)\[\]\[3\]\s*=\s*\{(.*?)\};", body, re.S):
        triples = re.findall(r"\{\s*(\d+),\s*(\d+),\s*(\d+)\s*\}", rows)
        arrays[name] = tuple(tuple(int(v) for v in triple) for triple in triples)
    chosen = dict(re.findall(r"kind == KIND_(\w+)\)\s*return \*count = \d+, (\w+);", body))
    last = re.search(r"\n\s*return \*count = (\d+), (\w+);", body)
    assert last
    (default,) = {t.name for t in BLOCK_TYPES if t.values == blocks.SUPER} - set(chosen)
    chosen[default] = last[2]
    counts = dict(re.findall(r"return \*count = (\d+), (\w+);", body))
    for name, array in arrays.items():
        assert int(next(c for c, a in counts.items() if a == name)) == len(array), name
    found = {kind: arrays[array] for kind, array in chosen.items()}
    assert found == {t.name: t.segments for t in BLOCK_TYPES if t.values == blocks.SUPER}


@pytest.mark.parametrize("block_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_agrees_on_each_types_block(block_type: BlockType) -> None:
    kind = gguf.GGMLQuantizationType[block_type.name]
    assert gguf.GGML_QUANT_SIZES[kind] == (block_type.values, block_type.size)


@pytest.mark.parametrize("block_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_segments_cover_each_block_byte_once(block_type: BlockType) -> None:
    covered = sorted((start, end) for start, end, _ in block_type.segments)
    assert covered[0][0] == 0 and covered[-1][1] == block_type.size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    for start, end, word in block_type.segments:
        if word == FIFTH_BITS:  # 32 fifth bits a block: 8 masks of 4 bits a row
            assert block_type.name in ("Q5_0", "Q5_1") and end - start == 4
        else:
            assert word in (2, 4) and (end - start) % word == 0


def test_the_packer_and_binding_read_the_one_table() -> None:
    assert gguf_linear.BLOCK_BYTES is blocks.BLOCK_BYTES
    assert {t.name: t.segments for t in BLOCK_TYPES} == blocks.SEGMENTS
    assert {t.name: (t.values, t.size) for t in BLOCK_TYPES} == blocks.BLOCK_SIZES
    assert gguf_linear.SEGMENTS is blocks.SEGMENTS  # the packer has no table of its own
