"""Export reads a Q4 GGUF's blocks from the loaded model (its `BlockLinear` weights), not
from the file again: the view must give the file's 4-bit values and fp16 scales exactly, in
the model's row order (Q/K rows un-permuted once, at load), and the modules export builds
must store them as they are. No lowering here: these run in a second."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

import slotserve as ss
from slotserve.export import ExportOptions, load_for_export
from slotserve.export.blocks import q4_blocks
from slotserve.export.bundle import Quant
from slotserve.export.program import KINDS, layer_linear, layer_weight
from slotserve.model.gguf_linear import BLOCK, BlockLinear
from slotserve.model.layers import DenseLinear
from slotserve.model.weights import LlamaWeights
from slotserve.testing import write_tiny_gguf


@pytest.fixture(scope="module", params=["Q4_1", "Q4_0"])
def q4_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    qtype: str = request.param
    return write_tiny_gguf(tmp_path_factory.mktemp(qtype) / f"tiny-{qtype}.gguf", "llama", qtype)


def load(path: Path, weights: str) -> ss.Model:
    """``gguf``: as `slotserve export` loads it (its blocks; no kernel built or needed)."""
    if weights == "gguf":
        return load_for_export(path, progress=False)
    return ss.load(path, weights=weights, progress=False)


def weights_of(model: ss.Model) -> LlamaWeights:
    assert model.weights is not None
    return model.weights


def test_the_blocks_are_the_fp32_models_weights_exactly(q4_file: Path) -> None:
    """Every projection's blocks give, bit for bit, the weights the fp32 load dequantises
    from the file (through gguf's own dequantiser and its own un-permutation of Q/K rows)."""
    blocks_model, fp32 = load(q4_file, "gguf"), load(q4_file, "fp32")
    assert blocks_model.weights is not None and fp32.weights is not None
    for i in range(blocks_model.info.n_layers):
        for kind in KINDS:
            linear, rows = layer_linear(blocks_model.weights, i, kind)
            assert isinstance(linear, BlockLinear) and linear.kind == "Q4_1", (i, kind)
            blocks = q4_blocks(linear).rows(rows)
            assert blocks.q.dtype == torch.uint8 and int(blocks.q.max()) <= 15
            expected = layer_weight(fp32.weights, i, kind)
            assert torch.equal(blocks.dequantize(), expected), (i, kind)
            if "Q4_0" in q4_file.name:  # converted exactly: m = -8d, no offsets to store
                assert torch.equal(blocks.m, -8 * blocks.d), (i, kind)


def test_the_scales_are_the_files_fp16_values(q4_file: Path) -> None:
    """``d`` (and a Q4_1 file's ``m``) are the file's own fp16 fields, read from its bytes."""
    model = load(q4_file, "gguf")
    assert model.weights is not None
    reader = gguf.GGUFReader(str(q4_file))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    size = 20 if tensor.tensor_type.name == "Q4_1" else 18
    raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, size)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(int(tensor.shape[1]), -1)
    linear, rows = layer_linear(model.weights, 1, "down")
    assert isinstance(linear, BlockLinear)
    blocks = q4_blocks(linear).rows(rows)
    assert torch.equal(blocks.d, torch.from_numpy(d))
    if size == 20:
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(d.shape)
        assert torch.equal(blocks.m, torch.from_numpy(m))


def test_rows_of_a_partial_group_keep_their_own_blocks() -> None:
    """Five rows of three blocks: the kernel interleaves them as one group of five (not a
    whole group of 8), and each row's blocks come back as its own."""
    gen = np.random.default_rng(0)
    weights = gen.standard_normal((5, 3 * BLOCK)).astype(np.float32)
    rows = torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1))
    linear = BlockLinear.from_gguf(rows, "Q4_1")
    blocks = q4_blocks(linear)
    assert blocks.q.shape == (5, 3 * BLOCK) and blocks.d.shape == blocks.m.shape == (5, 3)
    assert torch.equal(blocks.dequantize(), linear.dequantize())


def test_q8_0_matrices_have_no_4bit_blocks(tmp_path: Path) -> None:
    model = load(write_tiny_gguf(tmp_path / "q8.gguf", "llama", "Q8_0"), "gguf")
    assert model.weights is not None
    linear = model.weights.layers[0].qkv
    assert isinstance(linear, BlockLinear) and linear.kind == "Q8_0"
    with pytest.raises(ValueError, match="Q8_0 BlockLinear has no 4-bit blocks"):
        q4_blocks(linear)


def module_weights(model: ss.Model, quant: Quant) -> dict[str, torch.Tensor]:
    from slotserve.export.bundle import _modules

    modules = _modules(model, ExportOptions(quant=quant), b"0" * 16)
    return {
        f"{name}.{key}": value
        for name, (module, _) in modules.items()
        for key, value in module.state_dict().items()
    }


def test_fp32_export_of_the_blocks_is_the_fp32_models(q4_file: Path) -> None:
    """`--quant fp32` of a model loaded with its blocks: the same weights, bit for bit, as
    the export of the same file loaded in fp32 (norms, embedding, head, every projection)."""
    ours = module_weights(load(q4_file, "gguf"), "fp32")
    theirs = module_weights(load(q4_file, "fp32"), "fp32")
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def test_8da4w_stores_the_files_blocks(q4_file: Path) -> None:
    """The int4 weights export hands to XNNPACK are the file's ``q − 8`` with the file's
    ``d`` as their scale; a Q4_1 file's offsets are the int8 correction, a Q4_0 file has
    none."""
    pytest.importorskip("torchao")
    from slotserve.export.program import Q4BlockLinear, int4_linears

    model = load(q4_file, "gguf")
    weights = weights_of(model)
    build = int4_linears(weights, model.info, model.source)
    for i in range(model.info.n_layers):
        for kind in KINDS:
            module = build(i, kind)
            assert isinstance(module, Q4BlockLinear), (i, kind)
            linear, rows = layer_linear(weights, i, kind)
            assert isinstance(linear, BlockLinear)
            blocks = q4_blocks(linear).rows(rows)
            stored: Any = module.linear.weight  # torchao's int4 tensor: qdata, scale
            assert torch.equal(stored.qdata, (blocks.q.to(torch.int8) - 8)), (i, kind)
            assert torch.equal(stored.scale.float(), blocks.d), (i, kind)
            assert (module.offset is None) == ("Q4_0" in q4_file.name), (i, kind)


def test_8da4w_of_an_fp32_load_requantises_and_says_so(
    q4_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torchao")
    from slotserve.export.program import Q4BlockLinear, int4_linears

    model = load(q4_file, "fp32")
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        build = int4_linears(weights_of(model), model.info, model.source)
    assert "requantised in int4 groups of 32" in caplog.text and "weights='gguf'" in caplog.text
    assert not isinstance(build(0, "qkv"), Q4BlockLinear)


def test_export_loads_a_gguf_once_with_its_blocks(
    q4_file: Path, tiny_dirs: dict[str, Path]
) -> None:
    """No fp32 copy, no kernel built or run, and torch's threads left for lowering (loading
    block weights to serve them gives torch's own ops one thread)."""
    threads = torch.get_num_threads()
    model = load_for_export(q4_file, progress=False)
    assert torch.get_num_threads() == threads
    assert isinstance(weights_of(model).layers[0].qkv, BlockLinear)
    assert model.kernels.blocks is None and model.halves.kind == "eager"
    hf = weights_of(load_for_export(tiny_dirs["llama"], progress=False))
    assert isinstance(hf.layers[0].qkv, DenseLinear)


@pytest.mark.slow
def test_the_bundled_models_export_weights_are_its_fp32_ones(bundled: ss.Model) -> None:
    """On the real file (Q4_1 projections, a Q8_0 embedding tied to the head): what export
    reads from the model loaded with its blocks equals the fp32 load, bit for bit."""
    from slotserve.export.program import dense_embedding, head_weight

    blocks = load_for_export("bundled", progress=False)
    ours, theirs = weights_of(blocks), weights_of(bundled)
    assert torch.equal(dense_embedding(ours), dense_embedding(theirs))
    assert torch.equal(head_weight(ours), head_weight(theirs))
    for i in range(blocks.info.n_layers):
        assert torch.equal(ours.layers[i].attn_norm, theirs.layers[i].attn_norm)
        for kind in KINDS:
            linear, rows = layer_linear(ours, i, kind)
            assert isinstance(linear, BlockLinear) and linear.kind == "Q4_1", (i, kind)
            expected = layer_weight(theirs, i, kind)
            assert torch.equal(q4_blocks(linear).rows(rows).dequantize(), expected), (i, kind)
