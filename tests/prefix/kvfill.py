"""Pools without a model for the prefix store's tests: deterministic K/V rows a token and a
position give, written and attended through the compiled kernel, so a restored prefix can
be checked by the attention it gives (bit for bit) against one computed from scratch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build_kernels
from slotserve.prefix import ModelFingerprint, PrefixCache, PrefixStore, StoreIdentity

FULL = ModelInfo(
    arch="llama", n_layers=2, dim=16, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=32,
    vocab_size=50, max_context=64,
)  # fmt: skip
# Layer 1 attends over a window of 6: a ring in the cell layout.
WINDOWED = ModelInfo(
    arch="llama", n_layers=2, dim=16, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=32,
    vocab_size=50, max_context=64, sliding_window=(None, 6),
)  # fmt: skip
BS = 4
FINGERPRINT = ModelFingerprint("a" * 64, "block:Q8_0", "numerics-1")


def make_pool(
    info: ModelInfo = FULL,
    dtype: str = "fp32",
    num_blocks: int = 48,
    max_seqs: int = 3,
    layout: str = "cell",
) -> KVPool:
    """A pool of ``layout`` (the ring layout: a window of 8 and 2 sinks)."""
    config = KVConfig(
        layout=layout, max_seqs=max_seqs, max_context=48, block_size=BS,
        num_blocks=num_blocks if layout == "cell" else None, dtype=dtype, ring_window=8,
        sinks=2,
    )  # fmt: skip
    return KVPool(info, config, attention=build_kernels().attention)


def identity(pool: KVPool, fingerprint: ModelFingerprint = FINGERPRINT) -> StoreIdentity:
    return StoreIdentity(fingerprint, pool.kv_identity(), tuple(pool.payload_parts()))


def make_store(directory: Path, pool: KVPool, budget: int = 1 << 20, **options: Any) -> PrefixStore:
    options.setdefault("writer", False)
    return PrefixStore(directory, budget, identity(pool), pool.retains_from, **options)


def make_cache(
    directory: Path,
    info: ModelInfo = FULL,
    dtype: str = "fp32",
    budget: int = 1 << 20,
    layout: str = "cell",
    **options: Any,
) -> PrefixCache:
    """A cache over a new pool with a store in ``directory`` that writes every published
    prompt at once (``write_prompts``: these tests are about the files; the engine's
    policy, prompts written once hit, has tests of its own)."""
    pool = make_pool(info, dtype, layout=layout)
    write_prompts = options.pop("write_prompts", True)
    store = make_store(directory, pool, budget, **options)
    return PrefixCache(pool, 1 << 20, store, write_prompts=write_prompts)


def rows(info: ModelInfo, tokens: list[int], start: int, layer: int) -> torch.Tensor:
    """The fused ``[q | k | v]`` rows of ``tokens`` at positions ``start ..``: a function of
    the token, the position and the layer only."""
    width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    token = torch.tensor(tokens, dtype=torch.float32)[:, None]
    position = torch.arange(start, start + len(tokens), dtype=torch.float32)[:, None]
    column = torch.arange(width, dtype=torch.float32)[None]
    return torch.sin(token * 0.731 + position * 0.173 + column * 0.291 + layer * 1.7)


def step(pool: KVPool, session: int, tokens: list[int], start: int) -> list[torch.Tensor]:
    """Append ``tokens`` to ``session`` at ``start``; each layer's attention output."""
    batch = StepBatch([session], [start], [len(tokens)])
    pool.begin_step(batch)
    return [
        pool.update_and_attend(layer, rows(pool.info, tokens, start, layer), batch)
        for layer in range(pool.info.n_layers)
    ]


def prefill(
    cache: PrefixCache, session: int, tokens: list[int], extra: int = 4, *, keep: bool = False
) -> int:
    """Bind ``session`` through the cache, compute the rest of ``tokens`` and check that
    the rows computed after a restore attend exactly as from scratch; publish (``keep``:
    release into the cache instead). Returns how many positions were restored."""
    restored = cache.bind(session, tokens, len(tokens) + extra)
    out = step(cache.pool, session, tokens[restored:], restored)
    if restored:
        assert_same(out, reference(cache.pool, tokens), restored)
    if keep:
        cache.release_into(session, tokens)
    else:
        cache.publish(session, tokens)
    return restored


def reference(like: KVPool, tokens: list[int]) -> list[torch.Tensor]:
    """Each layer's attention of ``tokens`` computed whole, in a pool of its own shaped
    like ``like``."""
    pool = make_pool(like.info, like.config.dtype, max_seqs=1, layout=like.config.layout)
    pool.reserve(0, len(tokens))
    return step(pool, 0, tokens, 0)


def assert_same(out: list[torch.Tensor], whole: list[torch.Tensor], start: int) -> None:
    """``out`` (each layer's rows from position ``start``) equals ``whole``'s rows from
    ``start``, bit for bit."""
    for layer, (mine, theirs) in enumerate(zip(out, whole, strict=True)):
        assert torch.equal(mine, theirs[start:]), f"layer {layer} differs after a restore"
