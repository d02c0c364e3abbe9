"""The fused forward of GGUF block weights: each layer's two kernel calls compute what the
eager ops compute on the same weights, it covers exactly the models it can, and steps of
any shape through the pool agree with one pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import slotserve as ss
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model.block_forward import BlockLayers, Scratch
from slotserve.model.gguf_linear import BLOCK, padded_blocks
from slotserve.model.layers import rms_norm
from slotserve.testing import write_tiny_gguf


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0"])
def block_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ss.Model:
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtype=request.param)
    return ss.load(path, weights="gguf", progress=False)


def _layers(model: ss.Model) -> BlockLayers:
    layers = model._block_layers
    assert layers is not None
    return layers


def test_layer_calls_equal_the_eager_ops(block_model: ss.Model) -> None:
    info, weights, layers = block_model.info, block_model.require_weights(), _layers(block_model)
    eager, fused = weights.layers[1], layers.layers[1]
    rows = 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, info.dim, generator=gen)
    positions = torch.tensor([0, 3, 4, 9, 2])
    widest = max(info.dim, info.ffn_dim, info.n_heads * info.head_dim)
    h = torch.empty(rows, widest)
    q = torch.empty(rows, padded_blocks(widest) * BLOCK, dtype=torch.int8)
    scales = torch.empty(2, rows, padded_blocks(widest))
    scratch = Scratch(h.data_ptr(), q.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr())

    qkv = torch.empty(rows, (info.n_heads + 2 * info.n_kv_heads) * info.head_dim)
    rope = block_model.rope
    layers.kernel.layer_in(
        x, fused.attn_norm, info.norm_eps, fused.qkv, qkv, info.n_heads + info.n_kv_heads,
        info.head_dim, rope.cos, rope.sin, positions, scratch,
    )  # fmt: skip
    projected = eager.qkv(rms_norm(x, eager.attn_norm, info.norm_eps))
    rotated = (info.n_heads + info.n_kv_heads) * info.head_dim
    heads = projected[:, :rotated].reshape(rows, -1, info.head_dim)
    expected = torch.cat([rope.apply(heads, positions).flatten(1), projected[:, rotated:]], 1)
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)

    attn = torch.randn(rows, info.n_heads * info.head_dim, generator=gen)
    gate_up = torch.empty(rows, 2 * info.ffn_dim)
    out = x.clone()
    layers.kernel.layer_out(
        out, attn, fused.o, fused.mlp_norm, info.norm_eps, fused.gate_up, gate_up, fused.down,
        scratch,
    )  # fmt: skip
    residual = x + eager.o(attn)
    gate, up = eager.gate_up(rms_norm(residual, eager.mlp_norm, info.norm_eps)).chunk(2, -1)
    expected = residual + eager.down(F.silu(gate) * up)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_it_covers_block_llama_only(tmp_path: Path, block_model: ss.Model) -> None:
    assert block_model._block_layers is not None
    dense = ss.load(write_tiny_gguf(tmp_path / "f32.gguf", qtype="F32"), progress=False)
    assert dense._block_layers is None  # dense projections: the eager forward
    qwen3 = write_tiny_gguf(tmp_path / "qwen3.gguf", kind="qwen3", qtype="Q8_0")
    assert ss.load(qwen3, weights="gguf", progress=False)._block_layers is None  # q/k norms


def test_steps_of_any_shape_agree_with_one_pass(block_model: ss.Model) -> None:
    """Prefill chunks, decode steps (the KV kernel) and a batch of two sequences give the
    logits of one pass, up to the activations' int8 rounding (a value on a rounding edge
    may fall either side when the attention sums in another order)."""
    ids = list(range(3, 35))
    alone = block_model.logits(ids)
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
