"""End to end on the bundled model: greedy generation is identical with every layout."""

from __future__ import annotations

import dataclasses

import torch

import slotserve as ss
from slotserve.kv import KVConfig, KVPool, StepBatch


def greedy(model: ss.Model, config: KVConfig, prompt: list[int], n: int) -> list[int]:
    pool = KVPool(model.info, config)
    pool.reserve(0, len(prompt) + n)
    batch = StepBatch.single(0, len(prompt))
    pool.begin_step(batch)
    logits = model.prefill(torch.tensor(prompt), batch, pool)
    out: list[int] = []
    for position in range(len(prompt), len(prompt) + n):
        out.append(int(logits[0].argmax()))
        batch = StepBatch.single(position, 1)
        pool.begin_step(batch)
        logits = model.decode(torch.tensor(out[-1:]), batch, pool)
    pool.release(0)
    pool.check_integrity()
    return out


def test_flat_cell_ring_generate_the_same_tokens(bundled: ss.Model) -> None:
    prompt = bundled.tokenizer.encode(
        bundled.tokenizer.render_chat([{"role": "user", "content": "Name three colours."}])
    )
    flat = greedy(bundled, KVConfig(layout="flat", max_seqs=2, max_context=128), prompt, 24)
    cell = greedy(
        bundled, KVConfig(layout="cell", max_seqs=2, max_context=128, block_size=16), prompt, 24
    )
    # The ring keeps 100 positions: more than this context uses, so it must be exact too.
    ring = greedy(
        bundled, KVConfig(layout="ring", max_seqs=2, max_context=128, ring_window=100), prompt, 24
    )
    int8 = greedy(
        bundled, KVConfig(layout="cell", max_seqs=2, max_context=128, dtype="int8"), prompt, 24
    )
    assert flat == cell == ring
    agree = sum(a == b for a, b in zip(flat, int8, strict=True))
    assert agree >= 12, f"int8 KV agrees with fp16 (the default) on {agree}/24 greedy tokens"


def test_default_kv_is_fp16_at_llama_cpps_bytes_a_token(bundled: ss.Model) -> None:
    """The engine's default pool stores fp16 K/V: 30 layers x K and V x 3 heads x 64 x 2
    bytes = 23,040 bytes a position on the bundled model, llama.cpp's f16 default; fp32
    is twice that, int8 (a fp32 scale per 64) about half."""
    config = ss.EngineConfig(max_seqs=2, max_context=64)
    assert config.kv_dtype == KVConfig().dtype == "fp16"
    positions = config.max_seqs * config.max_context
    per_position = {
        dtype: KVPool(bundled.info, dataclasses.replace(config, kv_dtype=dtype).kv_config()).nbytes
        // positions
        for dtype in ("fp16", "fp32", "int8")
    }
    assert per_position == {"fp16": 23_040, "fp32": 46_080, "int8": 12_240}
