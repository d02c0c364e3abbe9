"""`bench speculative`'s peer files: llama-server runs the weights slotserve runs (the
file's own blocks, or the file dequantised to F32 where slotserve holds fp32 weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

import slotserve as ss
from slotserve.bench import llama_server
from slotserve.bench.speculative import _llama_file

QUANTIZE = llama_server.binary_dir() / "llama-quantize"


@pytest.mark.skipif(not QUANTIZE.is_file(), reason="llama-quantize: `make bench-deps`")
def test_llama_server_runs_the_weights_slotserve_runs(
    bundled: ss.Model, bundled_blocks: ss.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binaries = QUANTIZE.parent
    monkeypatch.setattr(llama_server, "cache_dir", lambda: tmp_path)  # the F32 file: here
    monkeypatch.setattr(llama_server, "binary_dir", lambda: binaries)
    assert _llama_file(bundled_blocks) == Path(bundled_blocks.source)
    f32 = _llama_file(bundled)  # the bundled file, held as fp32 weights
    assert f32 is not None and f32.parent == tmp_path / "models"
    tensors = {t.name: t for t in GGUFReader(f32).tensors}
    down = tensors["blk.0.ffn_down.weight"]
    assert down.tensor_type == GGMLQuantizationType.F32
    ours = bundled.weights.layers[0].down.weight  # type: ignore[union-attr]
    assert torch.equal(torch.from_numpy(down.data.copy()).reshape(ours.shape), ours)
