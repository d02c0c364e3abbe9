"""The compiled attention kernel: built wherever a C compiler is, identical bytes in the pool
and the same attention as the torch path, fused rows read in place, a clear refusal, a quiet
fallback without a compiler."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve.native
from slotserve.engine import EngineConfig
from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.kv.layouts import PrefixGroup, RingGroup
from slotserve.kv.plan import PrefixPlan, RingKernelPlan
from slotserve.native import build_kernels
from slotserve.native.attention import AttentionKernel, StepCells

# The bundled model's attention shape (9 query heads over 3 KV heads of 64) and a small one.
SHAPES = [
    ModelInfo("llama", 2, 576, 9, 3, 64, 64, 100, 64),
    ModelInfo("llama", 2, 32, 4, 2, 8, 64, 100, 64),
]
HAS_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None


def the_kernel() -> AttentionKernel:
    """The attention kernel `build_kernels` built (the tests that call this need it)."""
    kernel = build_kernels().attention
    assert kernel is not None
    return kernel


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One fused projection's rows ``[q | k | v]`` of ``q[T, H, D]``, ``k, v[T, KVH, D]``."""
    return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """`build_kernels` builds once per process: forget what it built around a test that
    changes how kernels are built."""
    slotserve.native._built.cache_clear()
    yield
    slotserve.native._built.cache_clear()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_the_kernel_builds_where_a_compiler_is() -> None:
    kernel = the_kernel()
    config = KVConfig(layout="cell", max_seqs=2, max_context=64)
    pool = KVPool(SHAPES[0], config, attention=kernel)
    prefix_groups = [g for g in pool.groups if isinstance(g, PrefixGroup)]
    assert prefix_groups and all(g.kernel is kernel for g in prefix_groups)
    # Without the argument a pool keeps torch SDPA for every step.
    plain = KVPool(SHAPES[0], config)
    assert all(g.kernel is None for g in plain.groups if isinstance(g, PrefixGroup))


def drive(
    pool: KVPool, info: ModelInfo, plans: list[list[int]], seed: int, strided: bool = False
) -> list[torch.Tensor]:
    """Run sessions through chunked steps (``plans[b]``: chunk sizes); every layer's output.
    Each layer's q, k, v are one fused projection's rows, as the executors have them: whole
    (contiguous) or, with ``strided``, the same rows as a slice of a wider tensor (row stride
    past the row's end), which the kernel reads in place."""
    gen = torch.Generator().manual_seed(seed)
    for b, plan in enumerate(plans):
        pool.reserve(b, sum(plan))
    outputs, done = [], [0] * len(plans)
    width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    for step in range(max(len(p) for p in plans)):
        live = [b for b, p in enumerate(plans) if step < len(p)]
        batch = StepBatch(live, [done[b] for b in live], [plans[b][step] for b in live])
        pool.begin_step(batch)
        for layer in range(info.n_layers):
            qkv = torch.randn(batch.n_tokens, width, generator=gen)
            if strided:
                wide = torch.full((batch.n_tokens, width + 11), float("nan"))
                wide[:, 5 : 5 + width] = qkv
                qkv = wide[:, 5 : 5 + width]
                assert qkv.stride() == (width + 11, 1)
                assert batch.n_tokens == 1 or not qkv.is_contiguous()
            outputs.append(pool.update_and_attend(layer, qkv, batch))
        pool.check_integrity()
        for b in live:
            done[b] += plans[b][step]
    return outputs


def assert_same_bytes(ours: KVPool, theirs: KVPool) -> None:
    """Every layer's stored K and V (and int8 scales) are bit for bit the same."""
    for mine, other in zip(ours.groups, theirs.groups, strict=True):
        assert mine.layers == other.layers
        for layer in mine.layers:
            for store, reference in (
                (mine.keys[layer], other.keys[layer]),
                (mine.values[layer], other.values[layer]),
            ):
                assert torch.equal(store.data, reference.data)
                if store.scales is not None:
                    assert reference.scales is not None
                    assert torch.equal(store.scales, reference.scales)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["flat", "cell"]),
    st.sampled_from(["fp32", "fp16", "bf16", "int8"]),
    st.sampled_from(SHAPES),
    # Chunks of any size: the kernel takes every step, prefill chunks and decodes alike.
    st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=6), min_size=1, max_size=4),
    st.integers(0, 1000),
    st.booleans(),
)
def test_kernel_writes_the_same_bytes_and_attends_alike(
    layout: str, dtype: str, info: ModelInfo, plans: list[list[int]], seed: int, strided: bool
) -> None:
    config = KVConfig(layout=layout, max_seqs=4, max_context=64, block_size=4, dtype=dtype)
    with_kernel = KVPool(info, config, attention=the_kernel())
    with_torch = KVPool(info, config)
    # The kernel reads the fused rows in place (``strided``: rows of a wider tensor); the
    # torch path takes views of them.
    kernel_outs = drive(with_kernel, info, plans, seed, strided)
    torch_outs = drive(with_torch, info, plans, seed)
    for kernel_out, torch_out in zip(kernel_outs, torch_outs, strict=True):
        torch.testing.assert_close(kernel_out, torch_out, rtol=0, atol=2e-5)
    assert_same_bytes(with_kernel, with_torch)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_every_step_takes_the_kernel() -> None:
    """One attention for prefill chunks and decodes (a row's result must not depend on
    which it was), on every layout; a pool given no kernel plans torch SDPA throughout."""
    info = SHAPES[1]
    for layout in ("flat", "cell", "ring"):
        config = KVConfig(layout=layout, max_seqs=2, max_context=64, ring_window=16)
        pool = KVPool(info, config, attention=the_kernel())
        (group,) = pool.groups
        assert isinstance(group, PrefixGroup | RingGroup)
        pool.reserve(0, 40)
        for batch in (StepBatch([0], [0], [30]), StepBatch([0], [30], [1])):
            pool.begin_step(batch)
            assert batch.plan is not None
            (plan,) = batch.plan.groups
            expected = RingKernelPlan if isinstance(group, RingGroup) else PrefixPlan
            assert isinstance(plan, expected)
            assert isinstance(plan.kernel, StepCells)
    plain = KVPool(info, KVConfig(layout="flat", max_seqs=2, max_context=64))
    (torch_group,) = plain.groups
    assert isinstance(torch_group, PrefixGroup)
    plain.reserve(0, 40)
    for batch in (StepBatch([0], [0], [30]), StepBatch([0], [30], [1])):
        plain.begin_step(batch)
        assert batch.plan is not None
        (plan,) = batch.plan.groups
        assert isinstance(plan, PrefixPlan) and plan.kernel is None


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_out_of_range_positions_are_refused_with_nothing_written() -> None:
    kernel = the_kernel()
    keys, values = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    q, k, v = torch.randn(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8)
    # Position 4 of a sequence whose cells cover positions 0..3.
    step = StepCells.of(
        torch.tensor([3]),
        torch.arange(4).view(1, 4),
        torch.tensor([0]),
        torch.tensor([4]),
        2,
        kernel.threads,
    )
    with pytest.raises(ValueError, match="position is past the cells"):
        kernel.update_and_attend(fused(q, k, v), 4, step, (keys, None), (values, None), None)
    assert not keys.any() and not values.any()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_a_window_limits_the_keys() -> None:
    kernel = the_kernel()
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(16, 1, 8, generator=gen), torch.randn(16, 1, 8, generator=gen)
    q = torch.randn(1, 2, 8, generator=gen)
    k, v = keys[9:10].clone(), values[9:10].clone()
    step = StepCells.of(
        torch.tensor([9]),
        torch.arange(16).view(1, 16),
        torch.tensor([0]),
        torch.tensor([9]),
        2,
        kernel.threads,
    )
    qkv = fused(q, k, v)
    out = kernel.update_and_attend(qkv, 2, step, (keys, None), (values, None), window=3)
    # The window's three keys (positions 7, 8, 9) by plain attention.
    scores = torch.einsum("hd,ld->hl", q[0], keys[7:10, 0]) / 8**0.5
    expected = scores.softmax(-1) @ values[7:10, 0]
    torch.testing.assert_close(out.view(2, 8), expected, rtol=0, atol=1e-6)


def test_without_a_compiler_the_pool_keeps_torch(
    fresh_kernels: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # a compiler that is not there
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        kernels = build_kernels()
    assert kernels.attention is None
    assert "kernel attention unavailable" in caplog.text
    assert "torch ops run instead" in caplog.text
    assert not list(tmp_path.glob("kernels/*.so"))
    pool = KVPool(SHAPES[1], KVConfig(layout="flat", max_seqs=2, max_context=64), kernels.attention)
    assert all(g.kernel is None for g in pool.groups if isinstance(g, PrefixGroup))
    assert len(drive(pool, SHAPES[1], [[3, 1, 1]], seed=0)) == 6


def test_kernels_can_be_turned_off() -> None:
    kernels = build_kernels("off")
    assert kernels.attention is None and kernels.blocks is None
    assert kernels.describe() == "none"


def test_the_kernels_option_is_validated() -> None:
    with pytest.raises(ValueError, match="kernels='fast' is not one of"):
        EngineConfig(kernels="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernels='fast' is not one of"):
        build_kernels("fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["flat", "cell", "ring"])
def test_strided_fused_rows_equal_contiguous_ones(layout: str) -> None:
    """`update_and_attend` on ``[q | k | v]`` rows read in place from a wider tensor (row
    stride past the row) is `update_and_attend` on contiguous rows, for every layout and
    both paths (the ring and the torch path take views of the rows), and the kernel path
    is the torch path (the kernel takes the decode steps of the flat and cell layouts
    where it builds)."""
    info, plans = SHAPES[0], [[5, 1, 1, 2], [1, 1, 3, 1]]
    config = KVConfig(layout=layout, max_seqs=2, max_context=64, ring_window=4)
    kernel = build_kernels().attention
    pools = {
        (name, strided): KVPool(info, config, attention=attention)
        for name, attention in (("kernel", kernel), ("torch", None))
        for strided in (False, True)
    }
    outputs = {key: drive(pool, info, plans, seed=3, strided=key[1]) for key, pool in pools.items()}
    for a, b in zip(outputs["kernel", True], outputs["kernel", False], strict=True):
        assert torch.equal(a, b)
    # SDPA on views of strided rows may round differently (in the last bit) from views of
    # contiguous ones; what it writes to the pool may not differ at all.
    for a, b in zip(outputs["torch", True], outputs["torch", False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for name in ("kernel", "torch"):
        assert_same_bytes(pools[name, True], pools[name, False])
    for a, b in zip(outputs["kernel", False], outputs["torch", False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert_same_bytes(pools["kernel", False], pools["torch", False])
