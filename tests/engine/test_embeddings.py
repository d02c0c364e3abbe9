"""Embedding requests through the engine: prefill only, admitted like any request, their
final hidden states pooled and normalised; against transformers' ``last_hidden_state`` on
the same tiny directories, and the same vector batched or alone, cached or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.engine.events import Pooling
from slotserve.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 40, 41, 42, 100, 7], [70, 71], list(range(3, 60))]
EMBED = SamplingParams(max_new_tokens=0)


def reference(path: Path, ids: list[int], pooling: Pooling) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"mean": hidden.mean(dim=0), "cls": hidden[0], "last": hidden[-1]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0)


def embed(engine: ss.Engine, prompts: list[list[int]], pooling: Pooling) -> list[torch.Tensor]:
    handles = [engine.submit(p, EMBED, pooling=pooling) for p in prompts]
    finals = [handle.result() for handle in handles]
    for final in finals:
        assert final.embedding is not None and not final.tokens  # nothing generated
    return [torch.tensor(f.embedding) for f in finals if f.embedding is not None]


# fp32 KV stores what transformers computes; fp16 KV (the default) rounds every K and V
# (measured: at most 1.9e-4 off transformers on these models, against at most 1e-4 for fp32).
KV_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-4}


@pytest.mark.parametrize("kv_dtype", sorted(KV_TOLERANCE))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_hidden_states_match_transformers(
    tiny_dirs: dict[str, Path], kind: str, pooling: Pooling, kv_dtype: str
) -> None:
    config = ss.EngineConfig(max_seqs=4, max_context=128, kv_dtype=kv_dtype)
    engine = ss.Engine(ss.load(tiny_dirs[kind]), config)
    try:
        for prompt, ours in zip(PROMPTS, embed(engine, PROMPTS, pooling), strict=True):
            expected = reference(tiny_dirs[kind], prompt, pooling)
            torch.testing.assert_close(ours, expected, rtol=0, atol=KV_TOLERANCE[kv_dtype])
            assert float(ours.norm()) == pytest.approx(1.0, abs=1e-5)
    finally:
        engine.close()


def test_batched_equals_alone_and_admission_counts(make_engine: object) -> None:
    """On the tiny model's dense fp32 weights (torch's own matmuls, which are not
    batch-invariant bit for bit), with fp32 KV; fp16 KV rounding turns those last-bit
    differences into up to 8e-6 (exactness is the block kernels' promise, test_exactness)."""
    engine = make_engine(max_seqs=4, max_context=128, max_batch_tokens=32, kv_dtype="fp32")  # type: ignore[operator]
    together = embed(engine, PROMPTS, "mean")  # co-batched, the long one in chunks
    alone = [embed(engine, [p], "mean")[0] for p in PROMPTS]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    stats = engine.stats()
    assert stats.admitted == 2 * len(PROMPTS) and stats.finished["length"] == 2 * len(PROMPTS)
    engine.check_integrity()


def test_with_the_prefix_cache_mean_pooling_restores_nothing(make_engine: object) -> None:
    engine = make_engine(  # type: ignore[operator]
        max_seqs=2, max_context=128, kv_layout="cell", prefix_cache_bytes=1 << 20
    )
    prompt = PROMPTS[2]
    text = engine.submit(prompt, SamplingParams(max_new_tokens=2, temperature=0))
    text.result()  # its prompt is now in the cache
    first, second = embed(engine, [prompt], "mean")[0], embed(engine, [prompt], "mean")[0]
    torch.testing.assert_close(first, second, rtol=0, atol=1e-6)
    last = engine.submit(prompt, EMBED, pooling="last").result()
    assert last.usage.cached_tokens == len(prompt) - 1  # the last row is always computed
    for pooling in ("mean", "cls"):  # every row pooled, or the first: none restored
        pooled = engine.submit(prompt, EMBED, pooling=pooling).result()
        assert pooled.usage.cached_tokens == 0


def test_an_embedding_request_generates_nothing(make_engine: object) -> None:
    engine = make_engine(max_seqs=2, max_context=64)  # type: ignore[operator]
    with pytest.raises(ValueError, match="max_new_tokens must be 0"):
        engine.submit([5, 6], SamplingParams(max_new_tokens=3), pooling="mean")
    assert engine.embeds
    plain = engine.submit([5, 6], SamplingParams(max_new_tokens=2)).result()
    assert plain.embedding is None


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_batched_embeddings_equal_alone_bit_for_bit_on_blocks(
    make_engine: object, bundled_blocks: ss.Model, pooling: Pooling
) -> None:
    """On the block kernels (batch-invariant, issue 25) an input's vector is the same bits
    whatever it is batched or chunked with: co-batched, the long one in chunks of 32,
    against each alone in one chunk."""
    prompts = [[1, *range(200, 260)], [1, 500, 501], [1, *range(900, 1000)]]
    engine = make_engine(bundled_blocks, max_seqs=4, max_context=128, max_batch_tokens=32)  # type: ignore[operator]
    together = embed(engine, prompts, pooling)
    alone = make_engine(bundled_blocks, max_seqs=1, max_context=128, max_batch_tokens=128)  # type: ignore[operator]
    for prompt, vector in zip(prompts, together, strict=True):
        assert torch.equal(embed(alone, [prompt], pooling)[0], vector)
