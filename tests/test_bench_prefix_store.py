"""``bench prefix``'s disk-tier variant on a tiny model: turn 5 after a restart restores
the conversation from the store's files (and without a store computes it whole), beside an
engine that never restarted, and the same at a real server killed with SIGKILL; the storm
of distinct prompts keeps the store within its disk budget (files evicted) while step
times are measured with the store on and off; the section renders the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.bench.prefix import system_prompt
from slotserve.bench.prefix_store import STORM_PROMPTS, run_prefix_store, store_section
from slotserve.testing import write_tiny_hf_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    """The tiny Llama with a 1,024-token context: its tokens are bytes, and a random reply's
    bytes decode to replacement characters that encode to three tokens each, so its chat of
    5 turns outgrows the usual 256."""
    path = write_tiny_hf_dir(tmp_path_factory.mktemp("long") / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return ss.load(Path(path))


def test_the_store_variant_restores_after_a_restart_and_keeps_its_budget(
    tiny: ss.Model,
) -> None:
    system = system_prompt(tiny, 64)
    result = run_prefix_store(tiny, system, repeats=1, warm_up=False)
    restart = result["restart"]
    history = restart["history_tokens"]
    assert history > len(system)
    # The last turn's snapshot: the history less its last sampled token, never fed.
    assert restart["restored_tokens"] == restart["never_restarted_tokens"] == history - 1
    assert restart["cold_computed"] > history  # the whole history and turn 5's message
    assert restart["store_files"] >= 1 and restart["store_bytes"] > 0
    assert restart["read_s"]["median"] > 0
    assert restart["ratio_cold_over_restored"]["median"] > 0

    # The server killed with SIGKILL and started on its store restores the same history
    # (less the last reply's final token) as the one that never restarted; a cold one none.
    server = result["restart_server"]
    assert server["cached_restored"] == server["cached_never_restarted"] > len(system)
    assert server["cached_cold"] == 0 and server["history_tokens"] > server["cached_restored"]
    assert server["ratio_cold_over_restored"]["median"] > 0

    storm = result["storm"]
    store = storm["store"]
    assert store["bytes"] <= store["budget_bytes"]
    assert store["evictions"] > 0 and store["files"] < STORM_PROMPTS
    assert store["written"] + sum(store["skipped"].values()) >= STORM_PROMPTS
    for side in ("off", "on"):
        assert storm[side]["step_p99_s"]["median"] >= storm[side]["step_p50_s"]["median"] > 0

    # A chat workload: at most one file a turn with the defaults, fewer than every
    # published snapshot, and what was written restores the conversations after a restart.
    writes = result["writes"]
    before, after = writes["before"], writes["after"]
    assert after["written"] <= after["turns"] and after["files_per_turn"] <= 1
    assert after["bytes_written"] < before["bytes_written"]
    assert after["restored_after_restart"] > 0
    assert after["bytes_per_restored_token"] > 0

    text = "\n".join(store_section(result))
    assert "### prefix: the disk tier" in text
    assert "| restarted, store on |" in text and "| on |" in text and "| off |" in text
    assert "| killed, restarted, store on |" in text
    assert f"{store['written']} files written" in text
    assert "| before |" in text and "| after |" in text
