"""`slotserve bench` machinery on a tiny model: scenarios run, JSON keeps its documented
field names, the report and the plots are written, and nothing leaks."""

from __future__ import annotations

from pathlib import Path

import slotserve as ss
from slotserve.bench import SCENARIOS
from slotserve.bench.plots import plot
from slotserve.bench.report import markdown_report


def test_every_scenario_on_a_tiny_model(tiny: ss.Model, tmp_path: Path) -> None:
    results = {name: run(tiny, repeats=1) for name, run in SCENARIOS.items()}
    concurrency = results["concurrency"]
    assert [row["sessions"] for row in concurrency["rows"]] == [1, 2, 4, 8]
    assert concurrency["scaling_8_vs_1"] > 0
    assert {"itl_ratio_isolate", "itl_ratio_fifo"} <= set(results["mixed"])
    bargein = results["bargein"]
    assert {"cancel_release_p50_s", "cancel_release_p99_s", "step_p99_s"} <= set(bargein)
    assert bargein["slots_in_use_end"] == 0 and bargein["kv_blocks_leaked"] == 0
    for row in results["memory"]["layouts"].values():
        assert row["measured_pool_bytes"] == row["planned_bytes"]
        assert row["peak_rss_bytes"] > 0
    images = {}
    for name, result in results.items():
        if plot(name, result, tmp_path / f"{name}.png"):
            assert (tmp_path / f"{name}.png").stat().st_size > 1000
            images[name] = f"{name}.png"
    report = markdown_report(results, "slotserve bench all", images)
    for heading in (
        "## single",
        "## concurrency",
        "## mixed",
        "## bargein",
        "## layouts",
        "## memory",
    ):
        assert heading in report
