"""The prefix cache's share of the KV pool, whether a model keeps the exactness the
cache's default relies on (`slotserve serve` turns it on only then; presets size it), and
opening an engine's cache over its pool."""

from __future__ import annotations

import dataclasses
from typing import Any

from slotserve.engine.config import EngineConfig
from slotserve.kv.pool import KVPool
from slotserve.memory import parse_bytes
from slotserve.model import Model
from slotserve.plan import CapacityPlan
from slotserve.prefix import PrefixCache, open_store


def open_prefix_cache(
    config: EngineConfig, model: Model, pool: KVPool, *, attention_kernel: bool
) -> PrefixCache | None:
    """The prefix cache of an engine over its ``pool`` (None when ``config`` gives it no
    bytes), with its disk tier when ``prefix_store`` is set, indexed now so the first
    request can hit (`PrefixStoreError` if its directory cannot be written). One cache per
    engine: every snapshot was computed with this model's weights, weight format, rope
    settings and KV dtype, so no key needs to name them and a change of any of them cannot
    produce a stale hit."""
    budget = config.prefix_cache_budget
    if not budget:
        return None
    store = None
    if config.prefix_store is not None:
        store = open_store(
            config.prefix_store, config.prefix_store_budget, model, pool,
            attention_kernel=attention_kernel,
            write_rate=parse_bytes(config.prefix_store_write_rate),
            min_tokens=config.prefix_store_min_tokens,
        )  # fmt: skip
    write_prompts = config.prefix_store_writes == "all"
    return PrefixCache(pool, budget, store, write_prompts=write_prompts)


def is_exact(model: Any, config: EngineConfig) -> bool:
    """Whether ``model`` served with ``config`` keeps the exactness guarantee (DESIGN: a
    request's logits do not depend on its batch, its chunking or a restored prefix): block
    halves on the compiled kernels, and the attention kernel on. Dense and int8 weights run
    torch's own products, whose rounding may depend on the number of rows, and torch's
    attention pads a step to its longest sequence."""
    halves = getattr(model, "halves", None)
    kernels = getattr(model, "kernels", None)
    return (
        getattr(halves, "kind", None) == "block"
        and getattr(kernels, "attention", None) is not None
        and config.kernels == "auto"
    )


def with_prefix_cache_share(config: EngineConfig, model: Any, share: float) -> EngineConfig:
    """``config`` with the prefix cache allowed ``share`` of the planned KV pool, in whole
    blocks (the plan's own rounding; cell layout). A pool that parks slots (flat rows,
    `with_parked_slots`) gets its cache whatever the share. Unchanged for another layout,
    or when the share is under one block. ``model`` has ``info``."""
    if not 0.0 < share < 1.0:
        return config
    plan = CapacityPlan(model.info, config.kv_config())  # the pool alone: no arena needed
    if plan.parks_slots:
        return with_parked_slots(config, model)
    if config.kv_layout != "cell":
        return config
    asked = dataclasses.replace(plan, prefix_cache_bytes=int(share * plan.kv_bytes))
    pinnable = asked.prefix_cache["pinnable_bytes"] if asked.prefix_cache else 0
    return dataclasses.replace(config, prefix_cache_bytes=pinnable) if pinnable else config


def with_parked_slots(config: EngineConfig, model: Any) -> EngineConfig:
    """``config`` with the prefix cache on where the pool parks slots (flat rows,
    `KVPool.parks_slots`): a finished session's slot keeps its KV as a snapshot until a
    request needs the slot, so a conversation's next turn computes only its new tokens, and
    nothing is copied or pinned. Its byte budget is one session's KV, what one parked slot
    holds; it bounds nothing beyond the pool. Unchanged for a pool that does not park."""
    plan = CapacityPlan(model.info, config.kv_config())  # the pool alone: no arena needed
    if not plan.parks_slots:
        return config
    return dataclasses.replace(config, prefix_cache_bytes=plan.bytes_per_session)
