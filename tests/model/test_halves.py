"""One definition of a family's layer: the eager halves, the fused block halves and a bundle's
program methods all run through the same loop (`run_layers`) and the same contract, and each
half computes what the eager half computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.info import RopeConfig
from slotserve.model import model as model_module
from slotserve.model.halves import StepContext, run_layers
from slotserve.model.layers import RopeTables
from slotserve.model.llama import EagerHalves
from slotserve.testing import write_tiny_gguf


@pytest.fixture(scope="module")
def three(tiny: ss.Model, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    blocks = ss.load(write_tiny_gguf(tmp_path_factory.mktemp("q") / "q.gguf", qtype="Q8_0"))
    return {"eager": tiny, "block": blocks, "program": ss.load(tiny_bundle)}


def test_every_model_runs_the_one_loop(three: dict[str, ss.Model], monkeypatch: Any) -> None:
    calls: list[str] = []

    def spy(halves: Any, *args: Any) -> torch.Tensor:
        calls.append(halves.kind)
        return run_layers(halves, *args)

    monkeypatch.setattr(model_module, "run_layers", spy)
    for kind, model in three.items():
        assert model.halves.kind == kind
        engine = ss.Engine(model, ss.EngineConfig(max_seqs=2, max_context=64, kv_layout="cell"))
        try:
            handle = engine.submit([1, 5, 9, 2], ss.SamplingParams(temperature=0, max_new_tokens=3))
            assert handle.result().reason == "length"
        finally:
            engine.close()
    assert set(calls) == {"eager", "block", "program"}


def test_program_methods_are_the_eager_halves(three: dict[str, ss.Model]) -> None:
    """The fp32 bundle of the tiny model: each method equals the eager half it was lowered
    from, on the same inputs."""
    tiny, program = three["eager"], three["program"].halves
    assert tiny.weights is not None
    eager = EagerHalves(tiny.weights, tiny.info)
    info = tiny.info
    tokens = torch.tensor([3, 7, 1, 9])
    context = StepContext.of(tiny.rope, torch.tensor([0, 1, 2, 5]))
    steps = program.begin_step(context), eager.begin_step(context)
    torch.testing.assert_close(program.embed(tokens), eager.embed(tokens))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, info.dim, generator=gen)
    attn = torch.randn(4, info.n_heads * info.head_dim, generator=gen)
    for layer in range(info.n_layers):
        got, expected = program.qkv(layer, x, steps[0]), eager.qkv(layer, x, steps[1])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        got = program.out(layer, x, attn, steps[0])
        expected = eager.out(layer, x, attn, steps[1])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    program.end_step(steps[0])
    eager.end_step(steps[1])
    torch.testing.assert_close(program.head(x), eager.head(x), rtol=1e-4, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4 * RopeTables.CHUNK - 1), min_size=1, max_size=24))
def test_rope_rows_are_each_positions_own_whatever_chunks_a_step_spans(
    positions: list[int],
) -> None:
    """A step's rotation rows, gathered from the chunks its positions fall in, are bit for
    bit the rows each position has alone (a chunk is computed whole, whichever step first
    needed it), and only those chunks are built."""
    tables = RopeTables(RopeConfig(theta=10000.0), 64, 4 * RopeTables.CHUNK)
    cos, sin = tables.rows(torch.tensor(positions))
    assert set(tables._chunks) == {p // RopeTables.CHUNK for p in positions}
    for row, position in enumerate(positions):
        alone = RopeTables(RopeConfig(theta=10000.0), 64, 4 * RopeTables.CHUNK)
        one_cos, one_sin = alone.rows(torch.tensor([position]))
        assert torch.equal(cos[row], one_cos[0]) and torch.equal(sin[row], one_sin[0])


def test_covered_tables_are_the_bytes_the_plan_counts(tiny: ss.Model, tmp_path: Path) -> None:
    """`Model.cover_positions` builds the rows of an engine's context, one table a rotation
    (Gemma 3's sliding-window layers have their own), and they hold what
    `ModelInfo.rope_table_bytes` plans for them."""
    gemma = ss.load(write_tiny_gguf(tmp_path / "gemma3.gguf", "gemma3"), progress=False)
    for model in (tiny, gemma):
        context = min(model.info.max_context, 2 * RopeTables.CHUNK)
        model.cover_positions(context)
        tables = [t for t in (model.rope, model.local_rope) if t is not None]
        assert len(tables) == (2 if model.info.rope_local is not None else 1)
        held = sum(c.nbytes + s.nbytes for t in tables for c, s in t._chunks.values())
        assert held == model.info.rope_table_bytes(context)
