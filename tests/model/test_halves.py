"""One definition of a family's layer: the eager halves, the fused block halves and a bundle's
program methods all run through the same loop (`run_layers`) and the same contract, and each
half computes what the eager half computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import slotserve as ss
from slotserve.model import model as model_module
from slotserve.model.halves import StepContext, run_layers
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
