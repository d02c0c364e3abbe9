"""`TwoPass` on XNNPACK's real kernels: the second pass recovers what per-token int8
activations lose, so a Q4 projection's output approaches the exact product with the file's
weights; and it stays one delegate-friendly graph (no planned copies of the passes)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from slotserve.export.blocks import Q4Blocks
from slotserve.export.program import Q4BlockLinear, TwoPass, activation_residual
from slotserve.model.gguf_linear import BLOCK


def run_lowered(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` exported with a dynamic row count, lowered to XNNPACK and run there."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torch.export import Dim, export

    program = export(module.eval(), (x,), dynamic_shapes=({0: Dim("t", max=x.shape[0])},))
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    buffer = edge.to_executorch().buffer  # the runtime reads it in place: keep it alive
    (y,) = Runtime.get().load_program(buffer).load_method("forward").execute([x])
    return torch.Tensor(y).clone()


def q4_0_blocks(rows: int, cols: int, gen: torch.Generator) -> Q4Blocks:
    """Random Q4_0 blocks (``m = −8d``, no offsets) whose scales XNNPACK keeps exactly (it
    holds block scales in bf16), so what remains of the error is the activations'."""
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, cols // BLOCK, generator=gen) * 0.02 + 0.005).bfloat16().float()
    return Q4Blocks(q=q, d=d, m=-8 * d)


def test_the_second_pass_recovers_the_activations_quantisation_error() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = q4_0_blocks(192, 256, gen)
    exact = blocks.dequantize()
    x = torch.randn(16, 256, generator=gen)
    x[:, 7] *= 30  # an outlier channel, as norms make: per-token int8 loses the rest
    expected = x @ exact.T
    one = run_lowered(Q4BlockLinear(blocks), x)
    two = run_lowered(TwoPass(Q4BlockLinear(blocks)), x)
    error_one = (one - expected).abs().max() / expected.abs().max()
    error_two = (two - expected).abs().max() / expected.abs().max()
    assert error_two < error_one / 100, (float(error_one), float(error_two))


def test_the_residual_is_what_a_per_token_int8_round_trip_loses() -> None:
    x = torch.randn(5, 64) * torch.linspace(0.1, 10, 5)[:, None]
    residual = activation_residual(x)
    low = x.amin(-1, keepdim=True).clamp(max=0)
    high = x.amax(-1, keepdim=True).clamp(min=0)
    step = (high - low) / 255
    assert (residual.abs() <= step / 2 + 1e-6).all()  # at most half a step per value
    assert torch.allclose((x - residual) / step, ((x - residual) / step).round(), atol=1e-3)


def test_8da4w_2pass_puts_every_projection_and_the_head_in_two_passes(tmp_path: Path) -> None:
    """The option's wiring, without lowering (a tiny 2-pass export takes minutes of the suite;
    the lowered `TwoPass` is the test above, the bundled model's export is measured in
    docs/EXECUTORCH-NOTES.md)."""
    import slotserve as ss
    from slotserve.export import ExportOptions
    from slotserve.export.bundle import Quant, _modules
    from slotserve.testing import write_tiny_gguf

    model = ss.load(
        write_tiny_gguf(tmp_path / "t.gguf", "llama", "Q4_1"), weights="gguf", progress=False
    )

    def projections(name: str, module: nn.Module) -> list[nn.Module]:
        if name.endswith("_qkv"):
            return [module.qkv]
        if name.endswith("_out"):
            return [module.o, module.gate, module.up, module.down]
        return [module.head] if name == "head" else []

    def two_passes(quant: Quant) -> list[bool]:
        modules = _modules(model, ExportOptions(quant=quant), b"0" * 16)
        linears = [p for name, (m, _) in modules.items() for p in projections(name, m)]
        assert len(linears) == 5 * model.info.n_layers + 1
        return [isinstance(linear, TwoPass) for linear in linears]

    assert all(two_passes("8da4w-2pass"))
    assert not any(two_passes("8da4w"))


def test_the_default_export_is_the_one_that_meets_the_agreement_target() -> None:
    """Issue 26: `slotserve export` with no --quant writes 8da4w-2pass, the export that meets
    the 95% teacher-forced agreement with llama.cpp on the bundled model (296/308 in two
    exports on 2026-12-03, against 287-289/308 in one pass; `python tools/bundle_step.py
    OUT/`, docs/EXECUTORCH-NOTES.md). The measurement itself takes a 15-minute export, so it
    is not in this suite; `TwoPass` on XNNPACK's kernels is the test above."""
    from slotserve.cli import build_parser
    from slotserve.export.bundle import QUANTS

    parser = build_parser()
    assert parser.parse_args(["export", "bundled", "out"]).quant == "8da4w-2pass"
    for quant in QUANTS:  # every export the library writes, named the same on the CLI
        assert parser.parse_args(["export", "bundled", "out", "--quant", quant]).quant == quant
