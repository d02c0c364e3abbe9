"""Engines of one process share the kernels' thread governor (`slotserve.engine.stepper`)."""

from __future__ import annotations

from pathlib import Path

import slotserve as ss
from slotserve.testing import write_tiny_gguf


def test_engines_on_the_same_kernels_share_one_thread_governor(tmp_path: Path) -> None:
    """The kernels are built once a process, so their thread count is the process's: a
    bench's engines with speculation on and off, or a server's models, must not each keep
    a governor of their own, each dropping or restoring the count on its own view (one
    engine's steps then ran on what the other's governor chose, and its speculation priced
    rows for the wrong count)."""
    model = ss.load(write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0"), progress=False)
    assert model.kernels.blocks is not None
    engines = [ss.Engine(model, ss.EngineConfig(max_seqs=1, max_context=64)) for _ in range(2)]
    try:
        governors = [engine._stepper.governor for engine in engines]
        assert governors[0] is not None and governors[1] is governors[0]
        assert governors[0].kernels[0] is model.kernels.blocks
    finally:
        for engine in engines:
            engine.close()
