"""A ragged batch (prefill chunks and decodes mixed, several slots) gives the same logits as
each sequence run alone from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits
from slotserve.kv import KVConfig, KVPool, StepBatch

# The tiny models' dense fp32 weights run on torch's own matmuls, whose last bits move with
# a step's shape; fp32 KV keeps those differences at 1e-6, where fp16 KV's rounding would
# turn some into its own 11-bit steps. (Bit-exact chunking is the block kernels' promise:
# tests/model/test_invariance.py runs every KV dtype.)
KV = "fp32"


def _pool(model: ss.Model, sessions: int, context: int) -> KVPool:
    config = KVConfig(layout="flat", max_seqs=sessions, max_context=context, dtype=KV)
    pool = KVPool(model.info, config)
    for session in range(sessions):
        pool.reserve(session, context)
    return pool


def _alone(model: ss.Model, ids: list[int]) -> torch.Tensor:
    return teacher_forced_logits(model, ids, kv_dtype=KV)


@pytest.mark.parametrize("kind", ["llama", "mixed"])
def test_chunked_prefill_and_decode_equal_one_pass(tiny_dirs: dict[str, Path], kind: str) -> None:
    model = ss.load(tiny_dirs[kind])
    ids = list(range(3, 43))
    kv = _pool(model, 2, 64)
    outputs = []
    for start, end in [(0, 7), (7, 8), (8, 20), (20, 21), (21, 40)]:
        batch = StepBatch.single(start, end - start, session=1)
        kv.begin_step(batch)
        outputs.append(model.forward(torch.tensor(ids[start:end]), batch, kv, all_logits=True))
    torch.testing.assert_close(torch.cat(outputs), _alone(model, ids), rtol=0, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(1, 6), min_size=1, max_size=4),  # chunk sizes of one sequence
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["llama", "mixed"]),
)
def test_ragged_batches_equal_sequences_alone(
    tiny_dirs: dict[str, Path], chunk_plans: list[list[int]], kind: str
) -> None:
    model = ss.load(tiny_dirs[kind])
    kv = _pool(model, len(chunk_plans), 32)
    gen = torch.Generator().manual_seed(len(chunk_plans))
    sequences = [
        torch.randint(3, 259, (sum(plan),), generator=gen).tolist() for plan in chunk_plans
    ]
    done = [0] * len(chunk_plans)
    collected: list[list[torch.Tensor]] = [[] for _ in chunk_plans]
    for step in range(max(len(plan) for plan in chunk_plans)):
        live = [b for b, plan in enumerate(chunk_plans) if step < len(plan)]
        lengths = [chunk_plans[b][step] for b in live]
        batch = StepBatch(sessions=live, starts=[done[b] for b in live], lengths=lengths)
        tokens = torch.tensor(
            [
                t
                for b, n in zip(live, lengths, strict=False)
                for t in sequences[b][done[b] : done[b] + n]
            ]
        )
        kv.begin_step(batch)
        logits = model.forward(tokens, batch, kv, all_logits=True).split(lengths)
        for b, n, out in zip(live, lengths, logits, strict=True):
            collected[b].append(out)
            done[b] += n
    for b, ids in enumerate(sequences):
        torch.testing.assert_close(torch.cat(collected[b]), _alone(model, ids), rtol=0, atol=1e-5)


def test_decode_returns_last_token_logits(tiny: ss.Model) -> None:
    kv = _pool(tiny, 3, 16)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    starts = [0, 0, 0]
    tokens = torch.tensor([t for p in prompts for t in p])
    batch = StepBatch([0, 1, 2], starts, [len(p) for p in prompts])
    kv.begin_step(batch)
    last = tiny.prefill(tokens, batch, kv)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(last[b], _alone(tiny, p)[-1], rtol=0, atol=1e-5)
    batch = StepBatch([0, 1, 2], [3, 2, 4], [1, 1, 1])
    kv.begin_step(batch)
    step = tiny.decode(torch.tensor([20, 21, 22]), batch, kv)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(step[b], _alone(tiny, [*p, 20 + b])[-1], rtol=0, atol=1e-5)


def test_overflow_is_refused_without_writing(tiny: ss.Model) -> None:
    kv = _pool(tiny, 1, 8)
    before = kv.groups[0].keys[0].data.clone()
    with pytest.raises(ss.ContextOverflow, match="9 positions"):
        kv.begin_step(StepBatch.single(0, 9))
    assert torch.equal(kv.groups[0].keys[0].data, before)
    with pytest.raises(ValueError, match="one token per sequence"):
        tiny.decode(torch.tensor([3, 4]), StepBatch.single(0, 2), kv)
