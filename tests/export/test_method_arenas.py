"""The plan counts a bundle's planned method memory once, not once a method: the ExecuTorch
runtime gives every host-only method one set of arenas, sized to the largest method's
(`slotserve.artifact.program.planned_method_bytes`). Checked here on the runtime itself,
with the bundled model's fp32 bundle, whose methods plan megabytes each at its 128-token
step: running twelve of them one after another must not make twelve arenas resident."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slotserve.artifact.program import planned_method_bytes
from slotserve.memory import rss_bytes, trim_heap

pytest.importorskip("executorch")
METHODS = [f"layer{i}_qkv" for i in range(12)]


def test_methods_share_one_planned_arena(bundled_fp32_export: Path) -> None:
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.runtime import Runtime

    program_file, weights_file = (
        bundled_fp32_export / "program.pte",
        bundled_fp32_export / "weights.ptd",
    )
    pte = deserialize_pte_binary(program_file.read_bytes())
    each = {plan.name: sum(plan.non_const_buffer_sizes) for plan in pte.program.execution_plan}
    assert planned_method_bytes(pte) == max(each.values())  # one arena id in these methods

    program = Runtime.get().load_program(program_file, data_path=weights_file)
    methods = [program.load_method(name) for name in METHODS]
    inputs = []
    for method in methods:  # the largest step each method takes, allocated up front
        meta = method.metadata
        shapes = [tuple(meta.input_tensor_meta(i).sizes()) for i in range(meta.num_inputs())]
        inputs.append([torch.randn(shape) for shape in shapes])
    methods[0].execute(inputs[0])  # the arena, and the delegate's one-time state
    # Each reading after the C heap gives its free pages back: what a method's run freed
    # (its outputs are copies, dropped here) is not an arena it keeps.
    trim_heap()
    before = rss_bytes()
    for method, args in zip(methods[1:], inputs[1:], strict=True):
        method.execute(args)
    trim_heap()
    grown = rss_bytes() - before
    separate = sum(each[name] for name in METHODS[1:])
    assert separate > 8 * 2**20, separate  # large enough for the resident set to tell
    assert grown < separate / 4, (grown, separate)
