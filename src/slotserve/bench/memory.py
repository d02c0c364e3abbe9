"""Scenario ``memory``: worst-case memory at max_seqs, planned vs measured, per layout."""

from __future__ import annotations

from typing import Any

from slotserve.kv import KVConfig, KVPool
from slotserve.memory import peak_rss_bytes, rss_bytes
from slotserve.model import Model
from slotserve.plan import CapacityPlan

LAYOUTS = {
    "flat": KVConfig(layout="flat", max_seqs=4, max_context=2048),
    "cell": KVConfig(layout="cell", max_seqs=4, max_context=2048, block_size=16),
    "ring (window 512)": KVConfig(layout="ring", max_seqs=4, max_context=2048, ring_window=512),
    "cell int8": KVConfig(layout="cell", max_seqs=4, max_context=2048, dtype="int8"),
}


def run_memory(model: Model, repeats: int = 1) -> dict[str, Any]:
    rows = {}
    for name, config in LAYOUTS.items():
        plan = CapacityPlan(model.info, config, model.weight_bytes)
        before = rss_bytes()
        pool = KVPool(model.info, config)
        for group in pool.groups:  # touch every page, as sessions at full context would
            for storage in (*group.keys.values(), *group.values.values()):
                storage.data.fill_(1)
        rows[name] = {
            "planned_bytes": plan.kv_bytes,
            "measured_pool_bytes": pool.nbytes,
            "rss_growth_bytes": rss_bytes() - before,
            "worst_case_bytes": plan.worst_case_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        del pool
    return {
        "max_seqs": 4,
        "max_context": 2048,
        "weights_bytes": model.weight_bytes,
        "layouts": rows,
    }
