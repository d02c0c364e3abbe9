"""Every kernel keeps its AVX2 and plain-C paths: built for lower instruction sets
(``-march=x86-64-v3``: AVX2 and F16C without VNNI or AVX-512; ``-march=x86-64``: SSE2, the
plain C loops), each computes what the native build and the torch reference compute."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build, build_kernels
from slotserve.native.attention import AttentionKernel
from slotserve.native.blocks import BlockKernel
from tests.model.test_gguf_linear import (
    blockwise_reference,
    blockwise_tolerance,
    file_blocks,
    gguf_rows,
)

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels"
)
LEVELS = {
    "native": build.FLAGS,
    "avx2": tuple(f.replace("native", "x86-64-v3") for f in build.FLAGS),
    "plain-c": tuple(f.replace("native", "x86-64") for f in build.FLAGS),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("width", [160, 576])  # a quad and a pair; 4 quads, a pair, 2 chunks
def test_block_products_at_every_level(level: str, kind: str, width: int) -> None:
    kernel = BlockKernel(build.load("blocks", LEVELS[level]), threads=2)
    gen = np.random.default_rng(7)
    weight = gen.standard_normal((37, width)) * gen.uniform(0.01, 1.0, (37, 1))
    rows, stored = gguf_rows(weight, kind)
    linear = file_blocks(weight, kind)
    for m in (1, 3, 4, 9):  # one row, the tail rows, a whole group of 4, both
        x = torch.from_numpy(gen.standard_normal((m, width)).astype(np.float32))
        got = kernel.linear(x, linear.kind, linear.packed, linear.in_features)
        expected = blockwise_reference(x, rows, stored)
        bound = blockwise_tolerance(x, rows, stored)
        assert bool(((got.double() - expected).abs() <= bound).all()), (level, m)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_attention_at_every_level(level: str, dtype: str) -> None:
    info = ModelInfo("llama", 2, 64, 4, 2, 16, 64, 100, 64)
    kernel = AttentionKernel(build.load("attention", LEVELS[level]), threads=2)
    config = KVConfig(layout="cell", max_seqs=2, max_context=32, block_size=4, dtype=dtype)
    pools = KVPool(info, config, attention=kernel), KVPool(info, config)  # kernel, torch
    gen = torch.Generator().manual_seed(3)
    width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    for pool in pools:
        for session in (0, 1):
            pool.reserve(session, 20)
    lengths = [(0, 5), (5, 1), (6, 1), (7, 2)]
    for start, n in lengths:
        batch = StepBatch([0, 1], [start, start], [n, n])
        qkv = torch.randn(2 * n, width, generator=gen)
        outs = []
        for pool in pools:
            pool.begin_step(batch)
            outs.append([pool.update_and_attend(layer, qkv, batch) for layer in range(2)])
        for got, expected in zip(*outs, strict=True):
            torch.testing.assert_close(
                got, expected, rtol=2e-2, atol=2e-2 if dtype == "int8" else 1e-4
            )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0"])
def test_a_rows_product_does_not_depend_on_its_batch(level: str, kind: str) -> None:
    """Row i of a batch (in a group of 8 rows with AVX-512 or 4 below it, or among the
    tail rows) is bit for bit the row alone, on every thread count."""
    gen = np.random.default_rng(11)
    linear = file_blocks(gen.standard_normal((33, 96)), kind)
    x = torch.from_numpy(gen.standard_normal((19, 96)).astype(np.float32))
    for threads in (1, 2):
        kernel = BlockKernel(build.load("blocks", LEVELS[level]), threads)
        batch = kernel.linear(x, linear.kind, linear.packed, linear.in_features)
        for i in range(19):
            alone = kernel.linear(x[i : i + 1], linear.kind, linear.packed, linear.in_features)
            assert torch.equal(batch[i : i + 1], alone), (level, threads, i)


@pytest.mark.parametrize("level", LEVELS)
def test_a_querys_attention_does_not_depend_on_its_batch(level: str) -> None:
    """A sequence's queries attend alike in one prefill chunk, one by one as decodes, and
    beside another sequence's chunk."""
    info = ModelInfo("llama", 1, 64, 4, 2, 16, 64, 100, 64)
    kernel = AttentionKernel(build.load("attention", LEVELS[level]), threads=2)
    config = KVConfig(layout="cell", max_seqs=2, max_context=32, block_size=4, dtype="fp16")
    width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    rows = torch.randn(12, width, generator=torch.Generator().manual_seed(5))
    chunked = KVPool(info, config, attention=kernel)
    chunked.reserve(0, 12)
    whole = StepBatch.single(0, 12)
    chunked.begin_step(whole)
    expected = chunked.update_and_attend(0, rows, whole)
    stepped = KVPool(info, config, attention=kernel)
    for session in (0, 1):
        stepped.reserve(session, 12)
    outs = []
    for start, n in [(0, 5), (5, 1), (6, 6)]:
        batch = StepBatch([1, 0], [start, start], [n, n])  # another sequence goes first
        stepped.begin_step(batch)
        both = torch.cat([rows[start : start + n].flip(0), rows[start : start + n]])
        outs.append(stepped.update_and_attend(0, both, batch)[n:])
    assert torch.equal(torch.cat(outs), expected)


def test_native_build_is_the_one_load_uses() -> None:
    built = build_kernels()
    assert built.attention is not None and built.blocks is not None
    assert build.library_path("blocks").exists() and build.library_path("attention").exists()
