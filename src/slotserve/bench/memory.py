"""Scenario ``memory``: a real server's peak resident set at its worst case against its
plan's total (`slotserve.bench.worst_case`), and the KV pool of each layout at max_seqs,
planned vs measured.

Each pool is measured in a fresh process, so the resident-size growth is the pool's own and
not memory the allocator had kept from earlier work.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

from slotserve.bench.worst_case import run_worst_case
from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool
from slotserve.memory import MemoryLedger, read_process
from slotserve.model import Model
from slotserve.plan import CapacityPlan

LAYOUTS = {
    "flat": KVConfig(layout="flat", max_seqs=4, max_context=2048),
    "cell": KVConfig(layout="cell", max_seqs=4, max_context=2048, block_size=16),
    "ring (window 512)": KVConfig(layout="ring", max_seqs=4, max_context=2048, ring_window=512),
    "cell int8": KVConfig(layout="cell", max_seqs=4, max_context=2048, dtype="int8"),
}


def probe() -> None:
    """In a child process: build the pool from stdin's JSON, write every page, report."""
    request = json.loads(sys.stdin.read())
    info = ModelInfo.from_json(request["info"])
    config = KVConfig(**request["config"])
    before = read_process()
    pool = KVPool(info, config)
    for group in pool.groups:  # touch every page, as sessions at full context would
        for storage in (*group.keys.values(), *group.values.values()):
            storage.data.fill_(1)
    print(
        json.dumps(
            {
                "pool_bytes": pool.nbytes,
                "rss_growth": read_process().resident - before.resident,
                "anonymous_growth": read_process().anonymous - before.anonymous,
                "peak_rss": read_process().peak,
            }
        )
    )


def _measure_all(info: ModelInfo, configs: dict[str, KVConfig]) -> dict[str, dict[str, int]]:
    """Each config's pool measured by `probe` in a fresh process of its own, the processes
    run side by side (each measures only itself; most of their time is importing torch)."""
    code = "from slotserve.bench.memory import probe; probe()"
    children = {}
    for name, config in configs.items():
        payload = json.dumps({"info": info.to_json(), "config": dataclasses.asdict(config)})
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        children[name] = (child, payload)
    results = {}
    for name, (child, payload) in children.items():
        out, err = child.communicate(payload)
        if child.returncode != 0:
            raise RuntimeError(f"memory probe of the {name} pool failed: {err.strip()[-500:]}")
        results[name] = json.loads(out)
    return results


# The server `run_memory` drives: the 4 slots x 2,048 tokens on the cell layout (the
# prefix cache on, as serve's default), and a grammars arena of the least one grammar needs,
# which the driver fills (the default 128 MiB would be a budget no run fills).
SERVER_SEQS, SERVER_CONTEXT = 4, 2048
GRAMMAR_FLAGS = ("--grammar-max-bytes", "4MiB", "--grammar-cache-bytes", "4MiB")


def server_flags(model: Model) -> tuple[str, ...]:
    """`slotserve serve`'s flags for the worst case of ``model`` (its context, if shorter)."""
    context = min(SERVER_CONTEXT, model.info.max_context)
    sizes = ("--max-seqs", str(SERVER_SEQS), "--max-context", str(context))
    return (*sizes, "--kv-layout", "cell", *GRAMMAR_FLAGS)


def run_memory(model: Model, repeats: int = 1) -> dict[str, Any]:
    """The server's worst case (``repeats`` rounds of it) and the pool of each layout."""
    server = run_worst_case(model.source, model.info.vocab_size, server_flags(model), repeats)
    rows = {}
    measurements = _measure_all(model.info, LAYOUTS)
    weights = MemoryLedger()  # each layout's plan: the model's weights and its pool
    weights.add("weights", model.weight_bytes, "computed", "the model's weights")
    for name, config in LAYOUTS.items():
        plan = CapacityPlan(model.info, config, weights)
        measured = measurements[name]
        rows[name] = {
            "planned_bytes": plan.kv_bytes,
            "measured_pool_bytes": measured["pool_bytes"],
            "rss_growth_bytes": measured["rss_growth"],
            "anonymous_growth_bytes": measured["anonymous_growth"],
            "worst_case_bytes": plan.worst_case_bytes,
            "peak_rss_bytes": measured["peak_rss"],
        }
    return {
        "max_seqs": 4,
        "max_context": 2048,
        "weights_bytes": model.weight_bytes,
        "layouts": rows,
        "server": server,
    }
