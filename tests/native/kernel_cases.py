"""The cases ``csrc/tests/check_kernels.c`` checks a build against: products of every
block type and attention calls of every KV dtype and code path, with the outputs of the
host's plain-C build (the reference), in the file format that program reads.

A product case is a matrix of 45 rows (five whole groups of 8 and a group of 5) and
`ROWS` activation rows, one of them all zeros and one with a zero super-block; the
reference computes all `ROWS` at once, and the checked build must give each row the same
bits on any leading subset of them. An attention call has queries of two sequences at
several positions, cells scattered over the storage, and enough work that it is shared
over threads; its variants take every branch of ``update_and_attend``: head size 64 and
another (with a tail past the 16-wide dot), a window with sinks, and step buffers.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve.model.gguf_linear import BlockLinear, to_q4_1
from slotserve.native.attention import AttendArgs, AttentionKernel, StepCells
from slotserve.native.blocks import KIND_CODES, BlockKernel
from slotserve.testing import random_gguf_rows

ROWS = 19  # activation rows of a product case; the check runs 1 .. ROWS of them
OUT_FEATURES = 45
# Every type the runtime keeps as blocks; Q4_0 is multiplied as the Q4_1 rows it loads as.
PRODUCT_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES["int8"] = torch.int8


@dataclass(frozen=True)
class Case:
    kind: bytes  # b"LINR" or b"ATTN"
    label: str
    arrays: dict[str, bytes]

    def encode(self) -> bytes:
        label = self.label.encode()
        assert len(label) < 28, self.label
        parts = [self.kind, label.ljust(28, b"\0"), struct.pack("<I", len(self.arrays))]
        for name, data in self.arrays.items():
            parts += [name.encode().ljust(32, b"\0"), struct.pack("<Q", len(data)), data]
        return b"".join(parts)


def raw(tensor: torch.Tensor | None) -> bytes:
    """A tensor's bytes as the kernel reads them (empty for None)."""
    if tensor is None:
        return b""
    flat = tensor.contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def int64s(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def product_label(kind: str) -> str:
    return f"linear {kind}"


def product_cases(reference: BlockKernel, in_features: int = 512) -> Iterator[Case]:
    """One product case per type in `PRODUCT_KINDS`, computed by ``reference``."""
    for seed, kind in enumerate(PRODUCT_KINDS):
        rows = torch.from_numpy(random_gguf_rows(kind, OUT_FEATURES, in_features, seed))
        if kind == "Q4_0":  # as the GGUF loader keeps it (exactly the same weights)
            linear = BlockLinear.from_gguf(to_q4_1(rows), "Q4_1")
        else:
            linear = BlockLinear.from_gguf(rows, kind)
        gen = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(ROWS, in_features, generator=gen) * torch.rand(ROWS, 1, generator=gen) * 3
        x[5] = 0.0  # a row of zeros: zero scales
        x[11, :256] = 0.0  # a zero block and a zero super-block in a row of others
        y = reference.linear(x, linear.kind, linear.packed, in_features)
        yield Case(
            b"LINR",
            product_label(kind),
            {
                "kind": int64s(KIND_CODES[linear.kind]),
                "shape": int64s(OUT_FEATURES, in_features, ROWS),
                "weights": raw(linear.packed),
                "x": raw(x),
                "y": raw(y),
            },
        )


# (label, head size, query heads, window, sinks, step buffers)
ATTENTION_VARIANTS = (
    ("d64", 64, 4, 0, 0, False),
    ("d40", 40, 8, 0, 0, False),  # a head size with a tail past the 16-wide dot
    ("window", 64, 4, 16, 4, False),
    ("step rows", 64, 4, 0, 0, True),
)


def attention_cases(library: ctypes.CDLL) -> Iterator[Case]:
    """One attention case per KV dtype and variant, computed by ``library``'s
    ``update_and_attend`` (on one thread)."""
    function = library.update_and_attend
    function.restype, function.argtypes = ctypes.c_int, [ctypes.c_void_p]
    for dtype_name, dtype in KV_DTYPES.items():
        for seed, (label, dim, heads, window, sinks, stepped) in enumerate(ATTENTION_VARIANTS):
            yield _attention_case(
                function,
                f"attend {dtype_name} {label}",
                dtype,
                dim,
                heads,
                window,
                sinks,
                stepped,
                seed,
            )


def _storage(
    gen: torch.Generator, cells: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV rows of ``dtype`` with random contents (int8: with random scales)."""
    if dtype == torch.int8:
        data = torch.randint(-127, 128, (cells, kv_heads, dim), generator=gen, dtype=torch.int8)
        return data, torch.rand(cells, kv_heads, generator=gen) * 0.05 + 1e-3
    return torch.randn(cells, kv_heads, dim, generator=gen).to(dtype), None


def _attention_case(
    function: Callable[..., int],
    label: str,
    dtype: torch.dtype,
    dim: int,
    heads: int,
    window: int,
    sinks: int,
    stepped: bool,
    seed: int,
) -> Case:
    kv_heads, key_len = 2, 40
    gen = torch.Generator().manual_seed(1000 + seed)
    # a chunk of sequence 0 at 28..33 and one of sequence 1 at 20..23
    seq = torch.tensor([0] * 6 + [1] * 4)
    pos = torch.tensor([*range(28, 34), *range(20, 24)])
    queries = len(seq)
    n_cells = 2 * key_len
    cells = torch.randperm(n_cells, generator=gen).reshape(2, key_len)
    split = -1
    if stepped:  # the new rows live in step buffers, named by cells from n_cells on
        split = n_cells
        cells[seq, pos] = split + torch.arange(queries)
    write = cells[seq, pos].clone()
    keys, values = (_storage(gen, n_cells, kv_heads, dim, dtype) for _ in range(2))
    step_rows = None
    if stepped:
        step_rows = (
            _storage(gen, queries, kv_heads, dim, dtype),
            _storage(gen, queries, kv_heads, dim, dtype),
        )
    before = _storage_arrays(keys, values, step_rows)
    qkv = torch.randn(queries, (heads + 2 * kv_heads) * dim, generator=gen)
    step = StepCells.of(write, cells, seq, pos, heads // kv_heads, 1, step_rows, split)
    out = torch.empty(queries, heads * dim)
    args: AttendArgs = AttentionKernel.arguments(qkv, heads, step, keys, values, window, sinks, out)
    assert function(ctypes.byref(args)) == 0, label
    after = _storage_arrays(keys, values, step_rows)
    arrays = {
        # the order check_kernels reads them in
        "shape": int64s(
            *(queries, heads, kv_heads, dim, window, sinks, key_len, split, int(args.dtype)),
            *(qkv.stride(0), qkv.stride(0)),
        ),
        "scale": struct.pack("<f", args.scale),
        "qkv": raw(qkv),
        "write": raw(step.write),
        "cells": raw(step.cells),
        "seq": raw(step.seq),
        "pos": raw(step.pos),
        "out": raw(out),
        **before,
        **{f"{name}_after": data for name, data in after.items()},
    }
    return Case(b"ATTN", label, arrays)


def _storage_arrays(
    keys: tuple[torch.Tensor, torch.Tensor | None],
    values: tuple[torch.Tensor, torch.Tensor | None],
    step_rows: tuple[
        tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
    ]
    | None,
) -> dict[str, bytes]:
    (key_step, key_step_scales), (value_step, value_step_scales) = step_rows or ((None, None),) * 2
    return {
        "keys": raw(keys[0]),
        "values": raw(values[0]),
        "key_scales": raw(keys[1]),
        "value_scales": raw(values[1]),
        "keys_step": raw(key_step),
        "values_step": raw(value_step),
        "key_step_scales": raw(key_step_scales),
        "value_step_scales": raw(value_step_scales),
    }


def write_cases(path: Path, blocks: BlockKernel, attention: ctypes.CDLL) -> int:
    """Every case, computed by the reference ``blocks`` and ``attention`` libraries, into
    ``path``; returns how many."""
    cases = [*product_cases(blocks), *attention_cases(attention)]
    with open(path, "wb") as handle:
        handle.write(b"SSKC" + struct.pack("<II", 1, len(cases)))
        for case in cases:
            handle.write(case.encode())
    return len(cases)
