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
from tests.model.test_gguf_linear import blockwise_reference, file_blocks, gguf_rows

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels"
)
LEVELS = {
    "native": build.FLAGS,
    "avx2": ("-O3", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC"),
    "plain-c": ("-O3", "-march=x86-64", "-fopenmp", "-shared", "-fPIC"),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_products_at_every_level(level: str, kind: str) -> None:
    kernel = BlockKernel(build.load("blocks", LEVELS[level]), threads=2)
    gen = np.random.default_rng(7)
    weight = gen.standard_normal((37, 160)) * gen.uniform(0.01, 1.0, (37, 1))
    rows, stored = gguf_rows(weight, kind)
    linear = file_blocks(weight, kind)
    for m in (1, 3, 4, 9):  # one row, the tail rows, a whole group of 4, both
        x = torch.from_numpy(gen.standard_normal((m, 160)).astype(np.float32))
        got = kernel.linear(x, linear.kind, linear.packed, linear.in_features)
        expected = blockwise_reference(x, rows, stored)
        scale = float(expected.abs().max())
        assert torch.allclose(got.double(), expected, rtol=0, atol=2e-5 * scale), (level, m)


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


def test_native_build_is_the_one_load_uses() -> None:
    built = build_kernels()
    assert built.attention is not None and built.blocks is not None
    assert build.library_path("blocks").exists() and build.library_path("attention").exists()
