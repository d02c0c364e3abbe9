"""The compiled KV kernel: built wherever a C compiler is, identical bytes in the pool and
the same attention as the torch path, views read in place, a clear refusal, a quiet
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

from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.kv.kernel import StepCells, attention_kernel
from slotserve.kv.layouts import KERNEL_MAX_QUERIES, PrefixGroup

# The bundled model's attention shape (9 query heads over 3 KV heads of 64) and a small one.
SHAPES = [
    ModelInfo("llama", 2, 576, 9, 3, 64, 64, 100, 64),
    ModelInfo("llama", 2, 32, 4, 2, 8, 64, 100, 64),
]
HAS_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None


@pytest.fixture
def fresh_kernel() -> Iterator[None]:
    """`attention_kernel` is cached per process: forget it around a test that changes how
    it is found."""
    attention_kernel.cache_clear()
    yield
    attention_kernel.cache_clear()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_the_kernel_builds_where_a_compiler_is() -> None:
    assert attention_kernel() is not None
    pool = KVPool(SHAPES[0], KVConfig(layout="cell", max_seqs=2, max_context=64))
    assert all(g.kernel is not None for g in pool.groups if isinstance(g, PrefixGroup))


def drive(
    pool: KVPool, info: ModelInfo, plans: list[list[int]], seed: int, rows: bool = False
) -> list[torch.Tensor]:
    """Run sessions through chunked steps (``plans[b]``: chunk sizes); every layer's output.
    Each layer's q, k, v are one fused projection's rows, as the executors have them: passed
    whole (``rows``, `update_and_attend_rows`) or as views."""
    gen = torch.Generator().manual_seed(seed)
    for b, plan in enumerate(plans):
        pool.reserve(b, sum(plan))
    outputs, done = [], [0] * len(plans)
    heads, kv_heads, dim = info.n_heads, info.n_kv_heads, info.head_dim
    for step in range(max(len(p) for p in plans)):
        live = [b for b, p in enumerate(plans) if step < len(p)]
        batch = StepBatch(live, [done[b] for b in live], [plans[b][step] for b in live])
        pool.begin_step(batch)
        for layer in range(info.n_layers):
            n = batch.n_tokens
            fused = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
            if rows:
                outputs.append(pool.update_and_attend_rows(layer, fused, batch))
                continue
            q, k, v = torch.split(fused, [heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
            out = pool.update_and_attend(
                layer,
                q.reshape(n, heads, dim),
                k.reshape(n, kv_heads, dim),
                v.reshape(n, kv_heads, dim),
                batch,
            )
            outputs.append(out)
        pool.check_integrity()
        for b in live:
            done[b] += plans[b][step]
    return outputs


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["flat", "cell"]),
    st.sampled_from(["fp32", "fp16", "bf16", "int8"]),
    st.sampled_from(SHAPES),
    # Chunks of up to 4: steps of <= KERNEL_MAX_QUERIES a sequence take the kernel, the
    # others torch.
    st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=6), min_size=1, max_size=4),
    st.integers(0, 1000),
)
def test_kernel_writes_the_same_bytes_and_attends_alike(
    layout: str, dtype: str, info: ModelInfo, plans: list[list[int]], seed: int
) -> None:
    pools = {
        attention: KVPool(
            info,
            KVConfig(
                layout=layout,
                max_seqs=4,
                max_context=64,
                block_size=4,
                dtype=dtype,
                attention=attention,
            ),
        )
        for attention in ("auto", "torch")
    }
    # The kernel's pool reads the fused rows in place; the torch pool gets views of them.
    outputs = {name: drive(pool, info, plans, seed, name == "auto") for name, pool in pools.items()}
    for kernel_out, torch_out in zip(outputs["auto"], outputs["torch"], strict=True):
        torch.testing.assert_close(kernel_out, torch_out, rtol=0, atol=2e-5)
    for ours, theirs in zip(pools["auto"].groups, pools["torch"].groups, strict=True):
        for layer in ours.layers:
            for mine, reference in (
                (ours.keys[layer], theirs.keys[layer]),
                (ours.values[layer], theirs.values[layer]),
            ):
                assert torch.equal(mine.data, reference.data)
                if mine.scales is not None:
                    assert reference.scales is not None
                    assert torch.equal(mine.scales, reference.scales)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_decode_steps_take_the_kernel_and_long_chunks_do_not() -> None:
    info = SHAPES[1]
    pool = KVPool(info, KVConfig(layout="flat", max_seqs=2, max_context=64))
    (group,) = pool.groups
    assert isinstance(group, PrefixGroup)
    pool.reserve(0, 40)
    long_chunk = StepBatch([0], [0], [KERNEL_MAX_QUERIES + 1])
    decode = StepBatch([0], [KERNEL_MAX_QUERIES + 1], [1])
    assert "kernel" not in group._plan(long_chunk, pool.sessions, info.n_heads)
    assert "kernel" in group._plan(decode, pool.sessions, info.n_heads)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_out_of_range_positions_are_refused_with_nothing_written() -> None:
    kernel = attention_kernel()
    assert kernel is not None
    keys, values = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    q, k, v = torch.randn(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8)
    # Position 4 of a sequence whose cells cover positions 0..3.
    step = StepCells.of(
        torch.tensor([3]), torch.arange(4).view(1, 4), torch.tensor([0]), torch.tensor([4]), 2
    )
    with pytest.raises(ValueError, match="position is past the cells"):
        kernel.update_and_attend(q, k, v, step, (keys, None), (values, None), None)
    assert not keys.any() and not values.any()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH")
def test_a_window_limits_the_keys() -> None:
    kernel = attention_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(16, 1, 8, generator=gen), torch.randn(16, 1, 8, generator=gen)
    q = torch.randn(1, 2, 8, generator=gen)
    k, v = keys[9:10].clone(), values[9:10].clone()
    step = StepCells.of(
        torch.tensor([9]), torch.arange(16).view(1, 16), torch.tensor([0]), torch.tensor([9]), 2
    )
    out = kernel.update_and_attend(q, k, v, step, (keys, None), (values, None), window=3)
    # The window's three keys (positions 7, 8, 9) by plain attention.
    scores = torch.einsum("hd,ld->hl", q[0], keys[7:10, 0]) / 8**0.5
    expected = scores.softmax(-1) @ values[7:10, 0]
    torch.testing.assert_close(out.view(2, 8), expected, rtol=0, atol=1e-6)


def test_without_a_compiler_the_pool_keeps_torch(
    fresh_kernel: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="slotserve.kv.kernel"):
        assert attention_kernel() is None
    assert "using torch SDPA" in caplog.text
    pool = KVPool(SHAPES[1], KVConfig(layout="flat", max_seqs=2, max_context=64))
    assert all(g.kernel is None for g in pool.groups if isinstance(g, PrefixGroup))
    assert len(drive(pool, SHAPES[1], [[3, 1, 1]], seed=0)) == 6


def test_the_environment_can_turn_the_kernel_off(
    fresh_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_ATTENTION", "torch")
    assert attention_kernel() is None


def test_attention_option_is_validated() -> None:
    with pytest.raises(ValueError, match="attention='fast' is not one of"):
        KVConfig(attention="fast")


@pytest.mark.parametrize("layout", ["flat", "cell", "ring"])
def test_fused_rows_equal_views(layout: str) -> None:
    """`update_and_attend_rows` on ``[q | k | v]`` rows is `update_and_attend` on their views,
    for every layout (the ring and the torch path take the views themselves)."""
    info, plans = SHAPES[0], [[5, 1, 1, 2], [1, 1, 3, 1]]
    config = KVConfig(layout=layout, max_seqs=2, max_context=64, ring_window=4)
    by_rows = drive(KVPool(info, config), info, plans, seed=3, rows=True)
    by_views = drive(KVPool(info, config), info, plans, seed=3)
    for a, b in zip(by_rows, by_views, strict=True):
        assert torch.equal(a, b)
