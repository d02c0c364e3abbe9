"""Each layout's update_and_attend equals a plain attention over the full history."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build_kernels

INFO = ModelInfo(
    arch="llama",
    n_layers=3,
    dim=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    vocab_size=100,
    max_context=64,
)
MIXED = dataclasses.replace(INFO, sliding_window=(None, 5, 3))


def reference_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    window: int | None,
    sinks: int = 0,
) -> torch.Tensor:
    """Plain attention of ``q[n, H, D]`` over a sequence's whole history ``keys[L, Hkv, D]``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(q.shape[-1])
    qp, kp = q_positions.view(-1, 1), torch.arange(keys.shape[0]).view(1, -1)
    allowed = kp <= qp
    if window is not None:
        allowed &= (qp - kp < window) | (kp < sinks)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], -1).float()


def effective_window(info: ModelInfo, config: KVConfig, layer: int) -> tuple[int | None, int]:
    """(window, sinks) the layout should implement for ``layer``."""
    if info.window(layer) is not None:
        return info.window(layer), 0
    if config.layout == "ring":
        return config.ring_window, config.sinks
    return None, 0


def run_and_compare(
    info: ModelInfo, config: KVConfig, kernel: bool, plans: list[list[int]], seed: int
) -> None:
    """Drive sessions through chunked steps (plans[b] = chunk sizes) and compare each
    layer's output with the reference over the accumulated history, each row of it as the
    pool's dtype stores it (fp32 as it is, fp16/bf16 rounded). With ``kernel`` the pool
    attends with the compiled kernel (where it builds), else with torch SDPA."""
    assert config.dtype != "int8", "the reference rounds by casting; int8 has scales"

    def stored(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(config.torch_dtype).float()

    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(info, config, attention=build_kernels().attention if kernel else None)
    for b, plan in enumerate(plans):
        pool.reserve(b, sum(plan))
    hist_k = {
        (b, layer): torch.zeros(0, info.n_kv_heads, info.head_dim)
        for b in range(len(plans))
        for layer in range(info.n_layers)
    }
    hist_v = dict(hist_k)
    done = [0] * len(plans)
    for step in range(max(len(p) for p in plans)):
        live = [b for b, p in enumerate(plans) if step < len(p)]
        lengths = [plans[b][step] for b in live]
        batch = StepBatch(live, [done[b] for b in live], lengths)
        pool.begin_step(batch)
        n = batch.n_tokens
        for layer in range(info.n_layers):
            q = torch.randn(n, info.n_heads, info.head_dim, generator=gen)
            k = torch.randn(n, info.n_kv_heads, info.head_dim, generator=gen)
            v = torch.randn(n, info.n_kv_heads, info.head_dim, generator=gen)
            qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
            out = pool.update_and_attend(layer, qkv, batch)
            window, sinks = effective_window(info, config, layer)
            offset = 0
            for b, length in zip(live, lengths, strict=True):
                rows = slice(offset, offset + length)
                hist_k[b, layer] = torch.cat([hist_k[b, layer], stored(k[rows])])
                hist_v[b, layer] = torch.cat([hist_v[b, layer], stored(v[rows])])
                positions = torch.arange(done[b], done[b] + length)
                expected = reference_attention(
                    q[rows], hist_k[b, layer], hist_v[b, layer], positions, window, sinks
                )
                torch.testing.assert_close(out[rows], expected, rtol=0, atol=1e-5)
                offset += length
        for b, length in zip(live, lengths, strict=True):
            done[b] += length
        pool.check_integrity()


# (config, whether the pool is given the compiled attention kernel); the default KV dtype
# (fp16), and fp32 where a test asks for it.
CONFIGS = [
    (KVConfig(layout="flat", max_seqs=4, max_context=64), True),
    (KVConfig(layout="cell", max_seqs=4, max_context=64, block_size=4), True),
    # The same layouts with torch SDPA for every step (`kernels="off"`).
    (KVConfig(layout="flat", max_seqs=4, max_context=64), False),
    (KVConfig(layout="cell", max_seqs=4, max_context=64, block_size=4), False),
    (KVConfig(layout="ring", max_seqs=4, max_context=64, ring_window=6), True),
    (KVConfig(layout="ring", max_seqs=4, max_context=64, ring_window=5, sinks=2), True),
    (KVConfig(layout="ring", max_seqs=4, max_context=64, ring_window=5, sinks=2), False),
]


def config_id(case: tuple[KVConfig, bool]) -> str:
    config, kernel = case
    return (
        f"{config.layout}-w{config.ring_window}-s{config.sinks}-{'kernel' if kernel else 'torch'}"
    )


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("case", CONFIGS, ids=config_id)
@pytest.mark.parametrize("info", [INFO, MIXED], ids=["full", "mixed"])
def test_ring_wrap_and_long_chunks(
    info: ModelInfo, case: tuple[KVConfig, bool], dtype: str
) -> None:
    # Chunks straddle the ring's end (4+3 over 6 or 5), one chunk is longer than the whole
    # window (9), then single-token decodes wrap again.
    config, kernel = dataclasses.replace(case[0], dtype=dtype), case[1]
    plans = [[4, 3, 9, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6]]
    run_and_compare(info, config, kernel, plans, seed=1)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(CONFIGS),
    st.sampled_from([INFO, MIXED]),
    st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=6), min_size=1, max_size=4),
    st.integers(0, 1000),
)
def test_random_ragged_batches(
    case: tuple[KVConfig, bool], info: ModelInfo, plans: list[list[int]], seed: int
) -> None:
    config, kernel = case
    run_and_compare(info, config, kernel, plans, seed)


def test_int8_is_close_and_small() -> None:
    # The bundled model's attention shape: 3 KV heads of 64 (one fp32 scale per 64 int8s).
    info = dataclasses.replace(INFO, n_heads=9, n_kv_heads=3, head_dim=64, dim=576)
    kernel = build_kernels().attention
    fp32 = KVPool(
        info,
        KVConfig(layout="cell", max_seqs=4, max_context=64, block_size=4, dtype="fp32"),
        kernel,
    )
    int8 = KVPool(
        info,
        KVConfig(layout="cell", max_seqs=4, max_context=64, block_size=4, dtype="int8"),
        kernel,
    )
    assert int8.nbytes <= 0.30 * fp32.nbytes
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, h, 64, generator=gen) for h in (9, 3, 3))
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    outs = []
    for pool in (fp32, int8):
        pool.reserve(0, 10)
        batch = StepBatch.single(0, 10)
        pool.begin_step(batch)
        outs.append(pool.update_and_attend(0, qkv, batch))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_storage_halves_the_footprint(dtype: str) -> None:
    fp32 = KVPool(INFO, KVConfig(layout="flat", max_seqs=2, max_context=64, dtype="fp32"))
    half = KVPool(INFO, KVConfig(layout="flat", max_seqs=2, max_context=64, dtype=dtype))
    assert half.nbytes * 2 == fp32.nbytes
