"""Placement rules: which layers share a layout, how many cells a session and a layer
take, and the storage groups they allocate. The pool allocates by these rules and the
capacity plan sizes by the same ones, so planned bytes equal measured bytes."""

from __future__ import annotations

from slotserve.info import ModelInfo
from slotserve.kv.config import KVConfig
from slotserve.kv.layouts import CellGroup, FlatGroup, GroupShape, LayerGroup, RingGroup
from slotserve.native.attention import AttentionKernel

Rule = tuple[str, int | None]  # (placement, attention window)


def layer_rules(info: ModelInfo, config: KVConfig) -> dict[Rule, list[int]]:
    """Which layers share a placement rule. Sliding-window layers get a ring of their
    window ("ring"); the others get the configured layout ("flat", "cell", or "ring-full"
    for a StreamingLLM-style ring with sinks)."""
    rules: dict[Rule, list[int]] = {}
    ring_fits = config.ring_window + config.sinks < config.max_context
    for layer in range(info.n_layers):
        window = info.window(layer)
        if window is not None and window < config.max_context:
            rule: Rule = ("ring", window)
        elif config.layout == "ring" and ring_fits:
            rule = ("ring-full", None)
        else:
            rule = ("flat" if config.layout == "ring" else config.layout, window)
        rules.setdefault(rule, []).append(layer)
    return rules


def cells_per_session(rule: Rule, config: KVConfig) -> int:
    """Cells one session can occupy in one layer under ``rule`` (its worst case)."""
    kind, window = rule
    if kind == "ring":
        assert window is not None
        return window
    if kind == "ring-full":
        return config.ring_window + config.sinks
    return config.max_context


def cells_per_layer(rule: Rule, config: KVConfig) -> int:
    """Cells one layer's storage holds under ``rule`` (the whole pool, all sessions)."""
    if rule[0] == "cell":
        return config.total_blocks * config.block_size
    return config.max_seqs * cells_per_session(rule, config)


def build_groups(
    info: ModelInfo, config: KVConfig, kernel: AttentionKernel | None = None
) -> list[LayerGroup]:
    """Allocate the storage of every layer, grouped by placement rule; flat and cell
    groups attend decode-sized steps with ``kernel`` where one is given."""
    shape = GroupShape(info.n_kv_heads, info.head_dim, config.torch_dtype)
    groups: list[LayerGroup] = []
    for (kind, window), layers in layer_rules(info, config).items():
        if kind == "ring":
            assert window is not None
            groups.append(RingGroup(layers, config.max_seqs, window, 0, shape, kernel))
        elif kind == "ring-full":
            groups.append(
                RingGroup(layers, config.max_seqs, config.ring_window, config.sinks, shape, kernel)
            )
        elif kind == "cell":
            groups.append(
                CellGroup(layers, config.total_blocks, config.block_size, shape, window, kernel)
            )
        else:
            groups.append(
                FlatGroup(layers, config.max_seqs, config.max_context, shape, window, kernel)
            )
    return groups
