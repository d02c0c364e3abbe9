"""The fused forward of GGUF block weights: each layer's two kernel calls compute what the
eager ops compute on the same weights, it covers exactly the models it can, and steps of
any shape through the pool agree with one pass."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model.block_forward import KEPT_CALLS, REUSED_ROWS, BlockHalves, BlockStep
from slotserve.model.halves import StepContext
from slotserve.model.llama import EagerHalves
from slotserve.testing import write_tiny_gguf


@pytest.fixture(
    scope="module",
    params=[("llama", "Q4_1"), ("llama", "Q8_0"), ("qwen3", "Q8_0"), ("gemma3", "Q4_K_M")],
    ids=lambda p: "-".join(p),
)
def block_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ss.Model:
    kind, qtype = request.param
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", kind, qtype)
    return ss.load(path, weights="gguf", progress=False)


def test_halves_equal_the_eager_halves(block_model: ss.Model) -> None:
    """The fused halves and the eager halves on the same blocks, layer by layer."""
    assert isinstance(block_model.halves, BlockHalves)
    info, weights = block_model.info, block_model.weights
    assert weights is not None
    fused, eager = block_model.halves, EagerHalves(weights, info)
    rows = 5
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 4, 9, 2])
    context = StepContext.of(block_model.rope, positions, block_model.local_rope)
    step = fused.begin_step(context)
    x = torch.randn(rows, info.dim, generator=gen)
    for layer in range(info.n_layers):
        torch.testing.assert_close(
            fused.qkv(layer, x, step), eager.qkv(layer, x, context), rtol=1e-5, atol=1e-5
        )
        attn = torch.randn(rows, info.n_heads * info.head_dim, generator=gen)
        expected = eager.out(layer, x, attn, context)
        got = fused.out(layer, x.clone(), attn, step)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    fused.end_step(step)
    torch.testing.assert_close(fused.head(x), eager.head(x), rtol=1e-5, atol=1e-5)


def test_it_covers_every_block_model_without_biases(tmp_path: Path, block_model: ss.Model) -> None:
    assert block_model.halves.kind == "block"
    dense = ss.load(write_tiny_gguf(tmp_path / "f32.gguf", qtype="F32"), progress=False)
    assert dense.halves.kind == "eager"  # dense projections
    qwen2 = write_tiny_gguf(tmp_path / "qwen2.gguf", kind="qwen2", qtype="Q8_0")
    model = ss.load(qwen2, weights="gguf", progress=False)
    assert model.weights is not None
    assert BlockHalves.refusal(model.weights, model.info) == "projection biases"
    assert model.halves.kind == "eager"  # still the file's blocks, under eager glue
    with pytest.raises(ValueError, match="do not cover this model: projection biases"):
        BlockHalves(model.weights, model.info, block_model.halves.kernel)


def test_steps_of_any_shape_agree_with_one_pass(block_model: ss.Model) -> None:
    """Prefill chunks, decode steps (the KV kernel) and a batch of two sequences give the
    logits of one pass, up to the activations' int8 rounding (a value on a rounding edge
    may fall either side when the attention sums in another order)."""
    ids = list(range(3, 35))
    alone = teacher_forced_logits(block_model, ids)
    pool = KVPool(block_model.info, KVConfig(layout="cell", max_seqs=2, max_context=64))
    for session in (0, 1):
        pool.reserve(session, 64)
    outputs = []
    for start, end in [(0, 9), (9, 10), (10, 11), (11, 20), (20, 21), (21, 32)]:
        # session 1 runs the same tokens beside session 0, one step behind on the first
        batch = StepBatch([0, 1], [start, start], [end - start] * 2)
        pool.begin_step(batch)
        tokens = torch.tensor(ids[start:end] * 2)
        logits = block_model.forward(tokens, batch, pool, all_logits=True)
        pool.check_integrity()
        half = end - start
        torch.testing.assert_close(logits[:half], logits[half:], rtol=0, atol=0)
        outputs.append(logits[:half])
    stepped = torch.cat(outputs)
    assert (stepped.argmax(-1) == alone.argmax(-1)).float().mean() >= 0.95
    assert (stepped - alone).abs().max() < 0.05 * alone.abs().max()


def test_threads_stepping_one_model_keep_their_own_buffers(block_model: ss.Model) -> None:
    """Decode-sized steps reuse their buffers and kernel arguments from one step to the next,
    each step holding its own: two threads stepping the same model at once each get what
    one alone gets."""
    ids = list(range(3, 27))

    def decode() -> torch.Tensor:
        pool = KVPool(block_model.info, KVConfig(layout="cell", max_seqs=1, max_context=32))
        pool.reserve(0, 32)
        rows = []
        for t, token in enumerate(ids):
            batch = StepBatch([0], [t], [1])
            pool.begin_step(batch)
            rows.append(block_model.forward(torch.tensor([token]), batch, pool))
        return torch.cat(rows)

    alone = decode()
    results: list[list[torch.Tensor]] = [[], []]
    threads = [
        threading.Thread(target=lambda i=i: results[i].extend(decode() for _ in range(3)))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(logits, alone) for run in results for logits in run)
    assert sum(len(run) for run in results) == 6


def test_a_step_holds_its_calls_alone_and_small_steps_reuse_them(block_model: ss.Model) -> None:
    """A small step takes the calls the last step of its size gave back (it builds none); a
    step that runs while another holds them builds its own; a step over `REUSED_ROWS` rows
    keeps none; at most `KEPT_CALLS` are kept, the most recently ended."""
    halves = block_model.halves
    assert isinstance(halves, BlockHalves)

    def begin(rows: int) -> BlockStep:
        positions = torch.arange(rows)
        return halves.begin_step(
            StepContext.of(block_model.rope, positions, block_model.local_rope)
        )

    first = begin(3)
    halves.end_step(first)
    again = begin(3)
    beside = begin(3)  # while `again` holds the kept calls
    assert again.calls is first.calls and beside.calls is not again.calls
    halves.end_step(again)
    halves.end_step(beside)
    assert {begin(3).calls, begin(3).calls} == {again.calls, beside.calls}
    large = begin(REUSED_ROWS + 1)
    halves.end_step(large)
    assert begin(REUSED_ROWS + 1).calls is not large.calls
    ended = []
    for rows in range(1, KEPT_CALLS + 2):
        step = begin(rows)
        halves.end_step(step)
        ended.append(step.calls)
    assert begin(1).calls is not ended[0]  # dropped: KEPT_CALLS sizes ended after it
    assert all(begin(rows).calls is calls for rows, calls in enumerate(ended[1:], 2))


def test_a_failed_step_still_ends(block_model: ss.Model) -> None:
    """`run_layers` ends a step whose attention raised, so its calls go back to the halves."""
    halves = block_model.halves
    assert isinstance(halves, BlockHalves)
    pool = KVPool(block_model.info, KVConfig(layout="cell", max_seqs=1, max_context=16))
    pool.reserve(0, 16)
    batch = StepBatch([0], [0], [1])
    pool.begin_step(batch)
    held = halves.begin_step(
        StepContext.of(block_model.rope, torch.zeros(1, dtype=torch.long), block_model.local_rope)
    )
    halves.end_step(held)  # the calls the failing step will take

    class Failing(_LayerByLayer):
        def update_and_attend(
            self, layer: int, qkv: torch.Tensor, batch: StepBatch
        ) -> torch.Tensor:
            raise RuntimeError("attention failed")

    with pytest.raises(RuntimeError, match="attention failed"):
        block_model.forward(torch.tensor([5]), batch, Failing(pool))
    step = halves.begin_step(
        StepContext.of(block_model.rope, torch.zeros(1, dtype=torch.long), block_model.local_rope)
    )
    assert step.calls is held.calls
    halves.end_step(step)


class _LayerByLayer:
    """A pool seen only through ``update_and_attend``: `run_layers` then calls each layer's
    halves and attention from Python."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def update_and_attend(self, layer: int, qkv: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        return self.pool.update_and_attend(layer, qkv, batch)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
@pytest.mark.parametrize("layout", ["flat", "cell"])
def test_a_steps_layers_in_one_call_equal_them_one_by_one(
    block_model: ss.Model, layout: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`BlockHalves.stack` (every layer and its attention in one kernel call) gives the
    loop's logits and K/V bit for bit, through prompt chunks of two sequences, ragged
    steps and decode steps; a model with ring layers (Gemma 3's sliding windows) runs the
    loop, which copies the ring's rows after each attention."""
    kernel = block_model.halves.kernel  # type: ignore[attr-defined]
    stacks = 0
    layer_stack = kernel.layer_stack

    def counted(args: object) -> None:
        nonlocal stacks
        stacks += 1
        layer_stack(args)

    monkeypatch.setattr(kernel, "layer_stack", counted)
    config = KVConfig(layout=layout, max_seqs=2, max_context=64, dtype=dtype)
    attention = block_model.kernels.attention
    pools = [KVPool(block_model.info, config, attention) for _ in range(2)]
    for pool in pools:
        for session in (0, 1):
            pool.reserve(session, 64)
    gen = torch.Generator().manual_seed(1)
    steps = [([0], [0], [7]), ([0, 1], [7, 0], [1, 12]), ([0, 1], [8, 12], [5, 1])]
    steps += [([0, 1], [13 + i, 13 + i], [1, 1]) for i in range(6)]
    for sessions, starts, counts in steps:
        batch = StepBatch(sessions, starts, counts)
        tokens = torch.randint(3, block_model.info.vocab_size, (sum(counts),), generator=gen)
        logits = []
        for pool, store in zip(pools, (pools[0], _LayerByLayer(pools[1])), strict=True):
            pool.begin_step(batch)
            logits.append(block_model.forward(tokens, batch, store, all_logits=True))
            pool.check_integrity()
        assert torch.equal(logits[0], logits[1])
    for one, other in zip(pools[0].groups, pools[1].groups, strict=True):
        for layer in one.layers:
            assert torch.equal(one.keys[layer].data, other.keys[layer].data)
            assert torch.equal(one.values[layer].data, other.values[layer].data)
    rings = bool(block_model.info.sliding_window)
    assert stacks == (0 if rings else len(steps))
