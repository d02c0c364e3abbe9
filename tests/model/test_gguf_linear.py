"""Linears on GGUF blocks: the kernel computes exactly llama.cpp's blockwise arithmetic
(checked against the same arithmetic written in torch), block layouts read as gguf-py reads
them, and a block-loaded model matches its dequantised twin and llama.cpp's reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits
from slotserve.model.gguf_linear import BlockEmbedding, BlockLinear, file_rows, to_q4_1
from slotserve.native import build, build_kernels
from slotserve.native.blocks import BLOCK_SIZES, BlockKernel
from slotserve.testing import random_gguf_rows, write_tiny_gguf


def gguf_rows(weight: np.ndarray, kind: str) -> tuple[torch.Tensor, str]:
    """``weight`` quantised by gguf-py as llama.cpp would: the file's rows (Q4_0 as Q4_1)."""
    quant = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(weight.astype(np.float32), quant)
    rows = torch.from_numpy(data.view(np.uint8).reshape(weight.shape[0], -1).copy())
    return (to_q4_1(rows), "Q4_1") if kind == "Q4_0" else (rows, kind)


def file_blocks(weight: np.ndarray, kind: str) -> BlockLinear:
    return BlockLinear.from_gguf(*gguf_rows(weight, kind))


def activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[m, k]`` as llama.cpp quantises it for these types: int8 ``q[m, k / 32, 32]``
    (float64) and the blocks' scales ``d[m, k / 32]`` (amax / 127, rounded half to even)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0  # fp32, as the kernel computes it
    # fp32 division, as the kernel divides (torch's scalar / tensor is a reciprocal times
    # the scalar, one ulp off for many values: tests/native/test_quants.divide)
    inverse = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    return torch.round(xb * inverse[..., None]).double(), d.double()


def weight_blocks(
    rows_bytes: torch.Tensor, kind: str, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The file's rows as integer weights ``[n, k / 32, 32]``, their scales ``dw`` and, for
    Q4_1 and the Q5 types, their mins ``mw`` (float64): a Q5_0 weight as Q5_1's, unsigned
    with ``mw = -16 dw``, as the kernel takes it."""
    grouped = rows_bytes.view(rows_bytes.shape[0], k // 32, -1)
    dw = grouped[:, :, 0:2].contiguous().view(torch.float16).double()[..., 0]
    if kind == "Q8_0":
        return grouped[:, :, 2:].contiguous().view(torch.int8).double(), dw, None
    mins = grouped[:, :, 2:4].contiguous().view(torch.float16).double()[..., 0]
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        qh = grouped[:, :, at : at + 4].contiguous().numpy()
        fifth = torch.from_numpy(np.unpackbits(qh, axis=2, bitorder="little")).double()
        packed = grouped[:, :, at + 4 :]
        u = torch.cat([packed & 0x0F, packed >> 4], dim=2).double() + 16 * fifth
        return u, dw, -16 * dw if kind == "Q5_0" else mins
    packed = grouped[:, :, 4:]
    return torch.cat([packed & 0x0F, packed >> 4], dim=2).double(), dw, mins


def blockwise_reference(x: torch.Tensor, rows_bytes: torch.Tensor, kind: str) -> torch.Tensor:
    """llama.cpp's arithmetic in float64 on the file's rows: activations in int8 blocks of
    32 (scale amax/127, rounded half to even), exact integer sums, one scale per block."""
    q, d = activation_blocks(x)
    w, dw, mw = weight_blocks(rows_bytes, kind, x.shape[1])
    sums = torch.einsum("mbj,nbj->mnb", q, w)  # exact: integers below 2^53
    offset = 0.0 if mw is None else torch.einsum("mb,nb->mn", d * q.sum(-1), mw)
    return torch.einsum("mnb,mb,nb->mn", sums, d, dw) + offset


def blockwise_tolerance(x: torch.Tensor, rows_bytes: torch.Tensor, kind: str) -> torch.Tensor:
    """How far the kernel's fp32 result may be from `blockwise_reference`: a few fp32
    roundings (2^-24 each) of what it adds, so 5e-7 times the size of what it adds (3,000
    random cases came within 13% of that bound). That
    is not the result's size. The kernel scales and adds each vector lane's partial sums of
    unsigned weights times int8 activations (a Q8_0 weight as w + 128 under VNNI), then
    the offsets (a Q4_1 block's mins; -128 dw for that Q8_0), and these cancel: a
    -0.0104 came from partial sums 4,000 times its size. So the size is bounded by the
    products' absolute values, each unsigned weight times |q|, plus the offsets' sizes."""
    q, d = activation_blocks(x)
    w, dw, mw = weight_blocks(rows_bytes, kind, x.shape[1])
    unsigned = w + 128 if mw is None else w
    mins = 128 * dw if mw is None else mw
    products = torch.einsum("mbj,nbj->mnb", q.abs(), unsigned.abs())
    offsets = torch.einsum("mb,nb->mn", d * q.abs().sum(-1), mins.abs())
    return 5e-7 * (torch.einsum("mnb,mb,nb->mn", products, d, dw.abs()) + offsets)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"]),
    rows=st.integers(1, 70),
    blocks=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 17, 18, 33, 40]),  # quads, a pair, chunks of 16
    m=st.integers(1, 11),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_is_blockwise_llama_cpp_arithmetic(
    kind: str, rows: int, blocks: int, m: int, threads: int, seed: int
) -> None:
    kernel = BlockKernel(build.load("blocks"), threads)
    gen = np.random.default_rng(seed)
    weight = gen.standard_normal((rows, blocks * 32)) * gen.uniform(0.01, 1.0, (rows, 1))
    rows_bytes, stored = gguf_rows(weight, kind)
    linear = BlockLinear.from_gguf(rows_bytes, stored)
    x = torch.from_numpy(gen.standard_normal((m, blocks * 32)).astype(np.float32))
    x[:, :32] *= 0.0 if seed % 5 == 0 else 1.0  # an all-zero block has scale 0
    got = kernel.linear(x, linear.kind, linear.packed, linear.in_features)
    expected = blockwise_reference(x, rows_bytes, stored)
    bound = blockwise_tolerance(x, rows_bytes, stored) + 1e-12
    assert bool(((got.double() - expected).abs() <= bound).all())


def test_rows_of_any_stride_and_leading_shape() -> None:
    gen = np.random.default_rng(1)
    linear = file_blocks(gen.standard_normal((40, 96)), "Q4_1")
    wide = torch.randn(5, 200)
    x = wide[:, 7:103]  # rows apart, not contiguous
    expected = linear(x.contiguous())
    assert torch.equal(linear(x), expected)
    assert torch.equal(linear(x.reshape(5, 1, 96)).reshape(5, 40), expected)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_dequantise_as_gguf_py_does(kind: str) -> None:
    weight = np.random.default_rng(2).standard_normal((12, 128)).astype(np.float32)
    quant = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(weight, quant)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, quant)).copy())
    linear = file_blocks(weight, kind)
    assert torch.equal(linear.dequantize(), expected.reshape(12, 128))
    rows = torch.tensor([3, 0, 11])
    assert torch.equal(BlockEmbedding(linear)[rows], expected.reshape(12, 128)[rows])


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(list(BLOCK_SIZES)),
    rows=st.integers(1, 40),  # whole groups of 8, a last group of fewer, or only that
    blocks=st.integers(1, 5),
    data=st.data(),
)
def test_interleaved_rows_give_back_the_files(
    kind: str, rows: int, blocks: int, data: st.DataObject
) -> None:
    """The kernel's layout moves a matrix's rows into groups of 8; every way back to rows
    (all of them, a lookup's, reordered, two matrices stacked) gives the file's bytes.
    gguf-py quantises the 32-value types; the K-quants' are random valid super-blocks."""
    gen = np.random.default_rng(rows * 10 + blocks)
    values = BLOCK_SIZES[kind][0]
    if values == 32:
        file, _ = gguf_rows(gen.standard_normal((rows, blocks * values)), kind)
    else:
        file = torch.from_numpy(random_gguf_rows(kind, rows, blocks * values, rows + blocks))
    linear = BlockLinear.from_gguf(file, kind)
    assert linear.packed.shape == file.shape
    assert torch.equal(file_rows(linear.packed, kind), file)
    picked = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=12)))
    assert torch.equal(file_rows(linear.packed, kind, picked), file[picked])
    quant = gguf.GGMLQuantizationType[kind]
    weights = torch.from_numpy(np.asarray(gguf.quants.dequantize(file.numpy(), quant), np.float32))
    assert torch.equal(linear.dequantize(picked), weights[picked])
    assert torch.equal(linear.dequantize(), weights)
    order = torch.from_numpy(gen.permutation(rows))
    assert torch.equal(file_rows(linear.rows(order).packed, kind), file[order])
    split = data.draw(st.integers(1, rows))
    parts = [BlockLinear.from_gguf(file[:split], kind)]
    if split < rows:
        parts.append(BlockLinear.from_gguf(file[split:], kind))
    assert torch.equal(BlockLinear.stack(parts).packed, linear.packed)


def test_misshapen_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="kind='Q3_K'"):
        BlockLinear.from_gguf(torch.zeros(2, 20, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match="whole 176-byte blocks"):
        BlockLinear.from_gguf(torch.zeros(2, 200, dtype=torch.uint8), "Q5_K")
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        BlockLinear.from_gguf(torch.zeros(2, 30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="are 40 bytes, got 20"):
        BlockLinear(torch.zeros(2, 20, dtype=torch.uint8), "Q4_1", 64)
    linear = BlockLinear.from_gguf(torch.zeros(2, 40, dtype=torch.uint8), "Q4_1")
    kernel = build_kernels().blocks
    assert kernel is not None
    with pytest.raises(ValueError, match="inputs of width 96"):
        kernel.linear(torch.zeros(1, 96), "Q4_1", linear.packed, 64)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_model_matches_its_dequantised_twin(tmp_path: Path, qtype: str) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    blocks = ss.load(path, weights="gguf", progress=False)
    dense = ss.load(path, weights="fp32", progress=False)
    assert blocks.weights is not None and dense.weights is not None
    assert isinstance(blocks.weights.layers[0].qkv, BlockLinear)
    assert blocks.weights.n_params == dense.weights.n_params
    assert blocks.weight_bytes < 0.3 * dense.weight_bytes
    tokens = [1, 5, 9, 2, 7, 3]
    a, b = teacher_forced_logits(blocks, tokens), teacher_forced_logits(dense, tokens)
    # Only the activations' int8 rounding differs (the weights are the same numbers).
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_gguf_weights_need_a_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights='gguf'"):
        ss.load(tmp_path / "model-dir", weights="gguf")


def test_bundled_block_weights(bundled_blocks: ss.Model, reference: dict[str, Any]) -> None:
    """The file's own blocks: the bundle's size resident, and llama.cpp's answers."""
    model = bundled_blocks
    gguf_bytes = ss.artifact.bundled_gguf_path().stat().st_size
    assert model.weight_bytes <= gguf_bytes
    agree = total = 0
    for case in reference["cases"]:
        prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
        top = (
            teacher_forced_logits(model, prompt + greedy[:-1])[len(prompt) - 1 :]
            .argmax(-1)
            .tolist()
        )
        for mine, theirs, margin in zip(
            top, case["teacher_forced_top1"], case["teacher_forced_margin"], strict=True
        ):
            total += 1
            agree += mine == theirs
            if margin >= 1.0:
                assert mine == theirs
    # Measured 299/308 (97.1%) on AVX-512 VNNI (AMD EPYC); fp32 weights get 296/308.
    assert agree / total >= 0.95, f"{agree}/{total}"


def test_auto_keeps_blocks_where_the_file_has_them(tmp_path: Path) -> None:
    q41 = ss.load(write_tiny_gguf(tmp_path / "q.gguf", qtype="Q4_1"), progress=False)
    f32 = ss.load(write_tiny_gguf(tmp_path / "f.gguf", qtype="F32"), progress=False)
    assert q41.weights is not None and f32.weights is not None
    assert isinstance(q41.weights.lm_head, BlockLinear)
    assert not isinstance(f32.weights.layers[0].qkv, BlockLinear)
    with pytest.raises(ValueError, match="weights='int4' is not one of"):
        ss.load(tmp_path / "q.gguf", weights="int4")


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_types_without_a_kernel_load_exactly_through_dequantisation(
    tmp_path: Path, qtype: str
) -> None:
    """Q2_K and Q3_K (no block kernel) load as gguf-py dequantises them, bit for bit."""
    path = write_tiny_gguf(tmp_path / "k.gguf", "gemma3", qtype)
    model = ss.load(path, progress=False)
    assert model.weights is not None and model.halves.kind == "eager"
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == qtype
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    got = model.weights.layers[0].down
    assert torch.equal(got.weight, torch.from_numpy(np.ascontiguousarray(expected)))
    assert teacher_forced_logits(model, [1, 2, 3]).isfinite().all()
