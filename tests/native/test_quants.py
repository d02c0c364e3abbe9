"""The block products of every weight type compute llama.cpp's arithmetic: the activations
quantised as llama.cpp quantises them for that type (Q8 blocks of 32, or Q8_K super-blocks
of 256), times the weights exactly as gguf-py dequantises the file's blocks, summed in
float64. Random valid blocks of every type, at every instruction-set level, and a row's
result is bit for bit the same in any batch."""

from __future__ import annotations

import platform

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.model.gguf_linear import BlockLinear, StackedBlocks
from slotserve.native import build, build_kernels
from slotserve.native.blocks import BLOCK_SIZES, BlockKernel, Matrix
from slotserve.testing import random_gguf_rows

KINDS = ("Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SUPER_KINDS = ("Q4_K", "Q5_K", "Q6_K")
LEVELS = {
    "native": build.FLAGS,
    # AVX-512 without VNNI: groups of 8 rows on the maddubs products
    "avx512": tuple(f.replace("native", "x86-64-v4") for f in build.FLAGS),
    "avx2": tuple(f.replace("native", "x86-64-v3") for f in build.FLAGS),
    "plain-c": tuple(f.replace("native", "x86-64") for f in build.FLAGS),
}
on_x86 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels"
)
X86_64_V4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def _runs_here(level: str) -> bool:
    """Whether this CPU runs ``level``'s code (x86-64-v4 needs AVX-512; the others run on
    any x86 these tests build for)."""
    if level != "avx512":
        return True
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "").split()
    except OSError:
        return False
    return X86_64_V4.issubset(flags)


LEVEL_PARAMS = [
    pytest.param(level, marks=pytest.mark.skipif(not _runs_here(level), reason="no AVX-512"))
    for level in LEVELS
]


def random_rows(kind: str, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Random valid GGUF rows of ``kind`` (`slotserve.testing.random_gguf_rows`)."""
    return torch.from_numpy(random_gguf_rows(kind, rows, in_features, seed))


def divide(numerator: float, denominators: torch.Tensor) -> torch.Tensor:
    """``numerator / denominators`` rounded as fp32 division is (as the C code and
    llama.cpp divide). Torch's scalar-by-tensor division multiplies by a reciprocal and is
    one ulp off for about half of the values of a small tensor, which moves a product that
    lies an ulp from .5 to the other integer (seen: one q off, 0.0098 on a Q4_K row)."""
    return torch.full_like(denominators, numerator) / denominators


def quantised_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` as llama.cpp's activation blocks for ``kind`` give it back, in float64."""
    m, k = x.shape
    if kind in SUPER_KINDS:  # Q8_K: 256 values, scale from the signed value of largest |x|
        xb = x.view(m, k // 256, 256)
        first = xb.abs().argmax(-1, keepdim=True)  # argmax returns the first maximum
        peak = torch.gather(xb, -1, first)[..., 0]
        by = torch.where(peak != 0, divide(-127.0, peak), torch.zeros_like(peak))  # fp32
        q = torch.round(xb * by[..., None]).clamp(max=127)
        d = torch.where(peak != 0, divide(1.0, by), torch.zeros_like(by))
        return (q.double() * d.double()[..., None]).view(m, k)
    xb = x.view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, divide(1.0, d), torch.zeros_like(d))
    q = torch.round(xb * inverse[..., None])
    return (q.double() * d.double()[..., None]).view(m, k)


def reference(x: torch.Tensor, rows: torch.Tensor, kind: str) -> torch.Tensor:
    """llama.cpp's product in float64: quantised activations times gguf-py's weights."""
    weight = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[kind])
    return quantised_activations(x, kind) @ torch.from_numpy(weight).double().T


def magnitude(x: torch.Tensor, rows: torch.Tensor, kind: str) -> torch.Tensor:
    """The same product over absolute values: what fp32 rounding error scales with. A
    K-quant super-block's sum is a difference of its scales' and its mins' terms, computed in
    fp32 as llama.cpp computes it, which random blocks can make nearly cancel (seen: an
    error of 2.4e-4 of the result; against this bound the worst of 3,000 cases per type
    was 1.2e-7, so `check` allows 1e-6 of it: a few fp32 ulps per block)."""
    weight = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[kind])
    return quantised_activations(x, kind).abs() @ torch.from_numpy(weight).double().abs().T


def check(
    got: torch.Tensor, expected: torch.Tensor, label: object, bound: torch.Tensor | None = None
) -> None:
    atol = 2e-5 * (float(expected.abs().max()) or 1.0)
    if bound is not None:
        atol = max(atol, 1e-6 * float(bound.max()))
    assert torch.allclose(got.double(), expected, rtol=0, atol=atol), label


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    rows=st.integers(1, 40),
    blocks=st.integers(1, 4),
    m=st.integers(1, 9),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_type_is_llama_cpp_arithmetic(
    kind: str, rows: int, blocks: int, m: int, threads: int, seed: int
) -> None:
    kernel = BlockKernel(build.load("blocks"), threads)
    in_features = blocks * BLOCK_SIZES[kind][0]
    data = random_rows(kind, rows, in_features, seed)
    linear = BlockLinear.from_gguf(data, kind)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, in_features, generator=gen) * torch.rand(m, 1, generator=gen) * 3
    got = kernel.linear(x, kind, linear.packed, in_features)
    check(got, reference(x, data, kind), (kind, rows, blocks, m), magnitude(x, data, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantise_as_gguf_py_does(kind: str) -> None:
    data = random_rows(kind, 5, 2 * BLOCK_SIZES[kind][0], seed=3)
    expected = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[kind])
    got = BlockLinear.from_gguf(data, kind).dequantize()
    assert torch.equal(got, torch.from_numpy(expected).float())


@on_x86
@pytest.mark.parametrize("level", LEVEL_PARAMS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_type_at_every_level(level: str, kind: str) -> None:
    kernel = BlockKernel(build.load("blocks", LEVELS[level]), threads=2)
    in_features = 2 * BLOCK_SIZES[kind][0] if kind in SUPER_KINDS else 160
    data = random_rows(kind, 37, in_features, seed=7)
    linear = BlockLinear.from_gguf(data, kind)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 9):  # one row, tails of 2 and 3 rows, a whole group of 4, both
        x = torch.randn(m, in_features, generator=gen)
        got = kernel.linear(x, kind, linear.packed, in_features)
        check(got, reference(x, data, kind), (level, kind, m))


@on_x86
@pytest.mark.parametrize("level", LEVEL_PARAMS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_product_does_not_depend_on_its_batch(level: str, kind: str) -> None:
    """Row i of a batch (in a group of rows that share one decoding of the weights: 8
    with AVX-512, 4 below it; or among the tail rows, a group of their own) is bit for bit
    the row alone, on every thread count and for every tail: batches of 2 to 17 rows."""
    in_features = 256 if kind in SUPER_KINDS else 96
    linear = BlockLinear.from_gguf(random_rows(kind, 33, in_features, seed=11), kind)
    x = torch.randn(17, in_features, generator=torch.Generator().manual_seed(5))
    for threads in (1, 2):
        kernel = BlockKernel(build.load("blocks", LEVELS[level]), threads)
        alone = [kernel.linear(x[i : i + 1], kind, linear.packed, in_features) for i in range(17)]
        for m in range(2, 18):
            batch = kernel.linear(x[:m], kind, linear.packed, in_features)
            for i in range(m):
                assert torch.equal(batch[i : i + 1], alone[i]), (level, kind, threads, m, i)


def test_a_stack_of_types_is_its_parts_side_by_side() -> None:
    """A chained matrix (Q5_0 rows, then Q8_0, then Q6_K: as a Q4_K_M file's fused Q/K/V
    may mix them) gives each part's product in its columns, called directly or chained."""
    kernel = build_kernels("auto").blocks
    assert kernel is not None
    parts = [
        BlockLinear.from_gguf(random_rows(kind, rows, 256, seed=rows), kind)
        for kind, rows in (("Q5_0", 12), ("Q8_0", 5), ("Q6_K", 9))
    ]
    stack = StackedBlocks(tuple(parts))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kernel.linear(x, p.kind, p.packed, 256) for p in parts], dim=1)
    assert stack.shape == (26, 256)
    assert torch.equal(stack(x), alone)
    chain = Matrix.chain([(p.packed, p.kind) for p in parts])
    assert torch.equal(kernel.multiply(x, chain, 26), alone)


def test_a_width_that_is_not_whole_super_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        BlockLinear(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", 128)
