"""The XNNPACK executor on a tiny Q4_1 GGUF model: the lowered program keeps the file's 4-bit
blocks exactly, so its logits track the eager model's up to the kernels' per-token int8
activation quantisation; it serves through the engine on any KV layout; and a batch gives
what each sequence gives alone (per-token quantisation makes rows independent)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.artifact.gguf_blocks import q4_blocks
from slotserve.cli.executors import executor_for, program_path
from slotserve.errors import ArtifactError
from slotserve.executor.xnnpack import XnnpackExecutor
from slotserve.export import export_layer_program
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.testing import write_tiny_gguf

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLOTSERVE_CACHE_DIR", str(directory))
        yield directory


@pytest.fixture(scope="module")
def q41(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[ss.Model, XnnpackExecutor]:
    """The tiny Q4_1 model and its executor, lowered once through `--executor xnnpack`'s
    path (`executor_for`), which caches the program by the file's digest."""
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("xnnpack") / "tiny-q4_1.gguf", "llama", "Q4_1")
    model = ss.load(gguf, progress=False)
    executor = executor_for("xnnpack", model, MAX_TOKENS)
    assert isinstance(executor, XnnpackExecutor)
    return model, executor


def test_the_program_is_cached_by_the_files_digest(
    q41: tuple[ss.Model, XnnpackExecutor], cache: Path
) -> None:
    model, executor = q41
    path = program_path(Path(model.source), MAX_TOKENS)
    assert executor.program_path == path and path.parent == cache
    written = path.stat().st_mtime_ns
    again = executor_for("xnnpack", model, MAX_TOKENS)  # found, not lowered again
    assert isinstance(again, XnnpackExecutor) and path.stat().st_mtime_ns == written
    assert executor_for("torch", model, MAX_TOKENS) is None


def test_a_step_larger_than_the_program_is_refused(
    q41: tuple[ss.Model, XnnpackExecutor],
) -> None:
    model, executor = q41
    pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=128))
    pool.reserve(0, 128)
    with pytest.raises(ValueError, match=f"exceeds the {MAX_TOKENS} the program"):
        _step(executor, pool, StepBatch.single(0, MAX_TOKENS + 1), [5] * (MAX_TOKENS + 1))


def test_xnnpack_needs_a_gguf(tiny: ss.Model) -> None:
    with pytest.raises(ValueError, match="needs a Q4_0/Q4_1 GGUF model"):
        executor_for("xnnpack", tiny, MAX_TOKENS)


def _step(
    executor: XnnpackExecutor, pool: KVPool, batch: StepBatch, ids: list[int]
) -> torch.Tensor:
    pool.begin_step(batch)
    return executor.step(torch.tensor(ids), batch, pool)


def test_blocks_are_the_files_weights_exactly(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import dequantize

    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", "Q4_1")
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        if tensor.tensor_type.name != "Q4_1":
            continue
        blocks = q4_blocks(reader, tensor.name, str(path))
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(blocks.q.shape)
        assert torch.equal(blocks.dequantize(), torch.from_numpy(expected.copy()))


def test_logits_track_the_eager_model(q41: tuple[ss.Model, XnnpackExecutor]) -> None:
    model, executor = q41
    gen = torch.Generator().manual_seed(0)
    agree = total = 0
    for length in (1, 7, 40):
        ids = torch.randint(3, 250, (length,), generator=gen).tolist()
        pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=MAX_TOKENS))
        pool.reserve(0, MAX_TOKENS)
        prefill = _step(executor, pool, StepBatch.single(0, length), ids)[0]
        decode = _step(executor, pool, StepBatch.single(length, 1), [ids[0]])[0]
        for ours, expected in (
            (prefill, model.logits(ids)[-1]),
            (decode, model.logits([*ids, ids[0]])[-1]),
        ):
            # int8 per-token activations: a small relative error, the same ranking mostly.
            error = (ours - expected).abs().max() / expected.abs().max()
            assert error < 0.1, float(error)
            agree += int(ours.argmax() == expected.argmax())
            total += 1
    assert agree >= total - 1, f"{agree}/{total}"


def test_a_batch_equals_each_sequence_alone(q41: tuple[ss.Model, XnnpackExecutor]) -> None:
    model, executor = q41
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    config = KVConfig(layout="cell", max_seqs=3, max_context=32)
    pool = KVPool(model.info, config)
    for session in range(3):
        pool.reserve(session, 32)
    batch = StepBatch([0, 1, 2], [0, 0, 0], [len(p) for p in prompts])
    together = _step(executor, pool, batch, [t for p in prompts for t in p])
    for b, prompt in enumerate(prompts):
        alone_pool = KVPool(model.info, config)
        alone_pool.reserve(0, 32)
        alone = _step(executor, alone_pool, StepBatch.single(0, len(prompt)), prompt)
        torch.testing.assert_close(together[b], alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["flat", "ring", "cell"])
def test_serves_through_the_engine(q41: tuple[ss.Model, XnnpackExecutor], layout: str) -> None:
    model, executor = q41
    config = ss.EngineConfig(max_seqs=2, max_context=MAX_TOKENS, kv_layout=layout, ring_window=16)
    params = ss.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    with ss.Engine(model, config, executor=executor) as engine:
        handles = [engine.submit([5, 6, 7, 8], params), engine.submit([9, 10], params)]
        finals = [h.result() for h in handles]
        engine.check_integrity()
    assert [f.reason for f in finals] == ["length", "length"]
    assert all(len(f.tokens) == 12 for f in finals)


def test_refuses_weights_that_are_not_4_bit_blocks(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "q8.gguf", "llama", "Q8_0")
    model = ss.load(gguf, progress=False)
    with pytest.raises(ArtifactError, match="not Q4_0 or Q4_1"):
        export_layer_program(model, gguf, tmp_path / "x.pte", max_tokens=8)


def test_refuses_models_outside_the_llama_layers(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", "Q4_1")
    model = ss.load(gguf, progress=False)
    with pytest.raises(ValueError, match="qkv_bias"):
        export_layer_program(model, gguf, tmp_path / "x.pte", max_tokens=8)


def test_the_plan_counts_the_program_and_not_the_dropped_layers(
    q41: tuple[ss.Model, XnnpackExecutor],
) -> None:
    model, executor = q41
    program = executor.program_path.stat().st_size
    kept = executor.model.weight_bytes  # embedding and norms only
    weights = model.weights
    assert kept == weights.embed.nbytes + weights.norm.nbytes
    assert executor.weight_bytes == program + kept < model.weight_bytes + program
    config = ss.EngineConfig(max_seqs=1, max_context=MAX_TOKENS)
    with ss.Engine(executor.model, config, executor=executor) as engine:
        assert engine.plan.to_dict()["arenas"]["weights"] == program + kept
    with pytest.raises(ValueError, match="handed to a lowered program"):
        executor.model.logits([5, 6])
