"""`slotserve bench` machinery on a tiny model: scenarios run, JSON keeps its documented
field names, options reach the scenarios through `run_bench` (and the command line goes
only through it), the report and the plots are written, and nothing leaks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.bench import OWN_SECTION_SCENARIOS, SCENARIOS, BenchOptions, run_bench
from slotserve.bench.options import scenario_kwargs
from slotserve.bench.plots import plot
from slotserve.bench.report import markdown_report
from slotserve.cli import main
from slotserve.cli.bench import SCENARIO_NAMES


def test_every_scenario_on_a_tiny_model(tiny: ss.Model, tmp_path: Path) -> None:
    results = {
        name: run(tiny, repeats=1)
        for name, run in SCENARIOS.items()
        if name not in OWN_SECTION_SCENARIOS
    }
    concurrency = results["concurrency"]
    assert [row["sessions"] for row in concurrency["rows"]] == [1, 2, 4, 8]
    assert concurrency["scaling_8_vs_1"] > 0
    assert {"itl_ratio_isolate", "itl_ratio_fifo", "share_sweep"} <= set(results["mixed"])
    bargein = results["bargein"]
    assert {"cancel_release_p50_s", "cancel_release_p99_s", "step_p99_s"} <= set(bargein)
    assert bargein["slots_in_use_end"] == 0 and bargein["kv_blocks_leaked"] == 0
    structured = results["structured"]
    assert [row["batch"] for row in structured["rows"]] == [1, 8]
    for row in structured["rows"]:
        assert row["step_ms_free"]["median"] > 0 and row["step_ms_constrained"]["median"] > 0
        assert row["step_ratio"]["median"] > 0
        assert row["sampling_ms_per_token_constrained"]["median"] > 0
    assert structured["step_ratio_batch_1"] > 0 and structured["step_ratio_batch_8"] > 0
    assert structured["grammar_first_compile_s"] > 0
    # The tool-call case needs a longer context (tests/test_bench_structured_tools.py).
    assert "max_context=256" in structured["tool_calls"]["skipped"]
    hostile = structured["hostile_schemas"]  # a real server beside 8 hostile schemas
    assert hostile["exit_status"] == 0 and hostile["health_ms_max"] > 0
    assert hostile["ttft_ratio"]["median"] > 0 and hostile["itl_ratio"]["median"] > 0
    assert structured["itl_while_compiling"]["itl_ratio_pool"]["median"] > 0
    for row in results["memory"]["layouts"].values():
        assert row["measured_pool_bytes"] == row["planned_bytes"]
        assert row["peak_rss_bytes"] > 0
    images = {}
    for name, result in results.items():
        if plot(name, result, tmp_path / f"{name}.png"):
            assert (tmp_path / f"{name}.png").stat().st_size > 1000
            images[name] = f"{name}.png"
    assert {"mixed", "structured"} <= set(images)
    report = markdown_report(results, "slotserve bench all", images)
    for heading in (
        "## single",
        "## concurrency",
        "## mixed",
        "### mixed: background share",
        "## bargein",
        "## structured",
        "### structured: a plain request beside hostile schemas, at the server",
        "## prefix",
        "## layouts",
        "## memory",
    ):
        assert heading in report
    assert "| 1 |" in report and "| 8 |" in report  # a structured row per batch size


def _sweep_point(share: float, ratio: float, tokens: int) -> dict[str, Any]:
    return {
        "background_min_share": share,
        "itl_p50_alone_s": 0.01,
        "itl_p50_with_background_s": 0.01 * ratio,
        "ratio_p50": ratio,
        "ratio_mean": ratio + 0.1,
        "ratio_p90": ratio + 0.5,
        "ratio": ratio,
        "background_tokens_during_turn": tokens,
    }


def test_share_sweep_is_a_table_and_a_panel(tmp_path: Path) -> None:
    sweep = [_sweep_point(0.0, 1.0, 0), _sweep_point(0.1, 1.25, 3), _sweep_point(0.3, 1.8, 9)]
    mixed = {
        "isolate": sweep[1],
        "fifo": _sweep_point(0.1, 2.5, 20),
        "itl_ratio_isolate": 1.25,
        "itl_ratio_fifo": 2.5,
        "share_sweep": sweep,
    }
    report = markdown_report({"mixed": mixed}, "slotserve bench mixed", {})
    lines = report.splitlines()
    header = lines.index(
        "| background share | ITL p50 ratio | ITL mean ratio | ITL p90 ratio "
        "| background tokens during the turn |"
    )
    assert lines[header + 2 : header + 5] == [
        "| 0 | 1.00 | 1.10 | 1.50 | 0 |",
        "| 0.1 (default) | 1.25 | 1.35 | 1.75 | 3 |",
        "| 0.3 | 1.80 | 1.90 | 2.30 | 9 |",
    ]
    assert plot("mixed", mixed, tmp_path / "mixed.png")
    assert (tmp_path / "mixed.png").stat().st_size > 1000
    del mixed["share_sweep"]  # an older result: the table and panel are left out
    assert "### mixed: background share" not in markdown_report({"mixed": mixed}, "x", {})
    assert plot("mixed", mixed, tmp_path / "old.png")


def test_options_reach_the_scenarios_through_run_bench(tiny_dirs: dict[str, Path]) -> None:
    spec = str(tiny_dirs["llama"])
    result = json.loads(
        run_bench(spec, "mixed", repeats=1, options=BenchOptions(shares=(0.0, 0.2)))
    )["mixed"]
    assert [point["background_min_share"] for point in result["share_sweep"]] == [0.0, 0.2]
    preset = BenchOptions(preset="voice", memory_budget="64MiB")
    bargein = json.loads(run_bench(spec, "bargein", repeats=1, options=preset))["bargein"]
    assert bargein["slots_in_use_end"] == 0 and bargein["kv_blocks_leaked"] == 0


def test_options_are_checked_before_the_model_loads() -> None:
    with pytest.raises(ValueError, match=r"shares applies to the scenario\(s\) mixed"):
        run_bench("no-such-model", "bargein", options=BenchOptions(shares=(0.1,)))
    with pytest.raises(ValueError, match="preset applies"):
        run_bench("no-such-model", "structured", options=BenchOptions(preset="chat"))
    with pytest.raises(ValueError, match="not one of"):
        run_bench("no-such-model", "nonesuch")
    with pytest.raises(ValueError, match=r"shares: 1.0 is not in \[0, 1\)"):
        BenchOptions(shares=(0.1, 1.0))
    with pytest.raises(ValueError, match="empty"):
        BenchOptions(shares=())
    with pytest.raises(ValueError, match="give preset too"):
        BenchOptions(memory_budget="1GiB")
    with pytest.raises(ValueError, match="preset='nope'"):
        BenchOptions(preset="nope")
    with pytest.raises(ValueError, match=r"streams applies to the scenario\(s\) servers"):
        run_bench("no-such-model", "mixed", options=BenchOptions(streams=(8,)))
    with pytest.raises(ValueError, match=r"draft_model applies to the scenario\(s\) speculative"):
        run_bench("no-such-model", "single", options=BenchOptions(draft_model="bundled"))
    with pytest.raises(ValueError, match="give draft_model too"):
        BenchOptions(draft_weights="fp32")
    with pytest.raises(ValueError, match="each at least 1"):
        BenchOptions(streams=(0, 8))
    with pytest.raises(ValueError, match="each count of streams once"):
        BenchOptions(streams=(8, 8))
    with pytest.raises(ValueError, match="empty"):
        BenchOptions(streams=())


def test_the_servers_rows_are_the_streams_given(tiny: ss.Model) -> None:
    """``--streams`` reaches `run_servers` as its levels, in ascending order; other
    scenarios take nothing from it."""
    options = BenchOptions(streams=(8, 2))
    assert scenario_kwargs("servers", options, tiny) == {"levels": (2, 8)}
    assert scenario_kwargs("executors", options, tiny) == {}


def test_command_line_runs_the_scenarios_through_run_bench(
    tiny_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (*SCENARIOS, "all") == SCENARIO_NAMES
    out = tmp_path / "mixed.json"
    args = ["bench", "mixed", "--model", str(tiny_dirs["llama"]), "--repeats", "1"]
    assert main([*args, "--background-share", "0.05", "--json", str(out)]) == 0
    sweep = json.loads(out.read_text())["mixed"]["share_sweep"]
    assert [point["background_min_share"] for point in sweep] == [0.05]
    assert json.loads(capsys.readouterr().out)["mixed"]["share_sweep"] == sweep
    assert main([*args, "--background-share", "0.5,1"]) == 2  # out of range: refused
    assert "shares: 1.0 is not in [0, 1)" in capsys.readouterr().err
    assert main(["bench", "structured", "--preset", "chat"]) == 2
    assert "preset applies to the scenario(s) mixed, bargein" in capsys.readouterr().err
    assert main(["bench", "servers", "--streams", "0,8"]) == 2
    assert "each at least 1" in capsys.readouterr().err


def test_prefix_scenario_on_a_tiny_model(tiny: ss.Model) -> None:
    from slotserve.bench.prefix import run_prefix

    result = run_prefix(tiny, repeats=1)
    system, n = result["system_tokens"], result["questions"]
    assert system == tiny.info.max_context // 8 and n == 8
    off, on = result["off"], result["on"]
    # Cache off computes every prompt whole; on, 7 of the 8 restore the system prompt.
    assert off["prompt_tokens_restored"] == 0
    # (at least: questions that open alike share a few more tokens).
    assert on["prompt_tokens_restored"] >= (n - 1) * system
    assert (
        on["prompt_tokens_computed"] + on["prompt_tokens_restored"]
        == (off["prompt_tokens_computed"])
    )
    assert result["ttft_ratio"]["median"] > 0 and result["prefill_tok_s_on"]["median"] > 0
    chat_on, chat_off = result["chat"]["on"], result["chat"]["off"]
    assert len(chat_on) >= 2
    assert [t["conversation_tokens"] for t in chat_on] == [
        t["conversation_tokens"] for t in chat_off
    ]
    computed_off = [t["prompt_tokens_computed"] for t in chat_off]
    assert computed_off == [t["conversation_tokens"] for t in chat_off]  # whole, growing
    for before, turn in itertools.pairwise(chat_on):
        # At least the previous turn's prompt is restored (a random model's reply may
        # not encode back to the same tokens, so it may be computed again).
        assert turn["prompt_tokens_restored"] >= before["conversation_tokens"]
        assert (
            turn["prompt_tokens_restored"] + turn["prompt_tokens_computed"]
            == (turn["conversation_tokens"])
        )


def test_executors_compares_a_bundle_with_the_model_it_came_from(
    tiny: ss.Model, tiny_bundle: Path
) -> None:
    from slotserve.bench.executors import reference_of, run_executors
    from slotserve.bench.report import replace_section

    bundle = ss.load(tiny_bundle)
    assert Path(reference_of(bundle)) == Path(tiny.source).resolve()
    result = run_executors(bundle, repeats=1)  # the reference is loaded from the manifest
    assert [row["sessions"] for row in result["rows"]] == [1, 2, 4, 8]
    for row in result["rows"]:
        assert row["decode_ratio"] > 0 and row["ttft_ratio"] > 0
        for name in ("torch", "executorch"):
            assert row[name]["aggregate_tok_s"]["median"] > 0 and row[name]["ttft_s"] > 0
    assert result["weight_bytes"]["executorch"] == bundle.weight_bytes
    document = "# Benchmarks\n\n## single: x\n\nold\n\n## executors: old\n\nold rows\n"
    updated = replace_section(document, "executors", {"executors": result}, "slotserve bench")
    assert "old rows" not in updated and "## single: x" in updated
    assert updated.count("## executors:") == 1 and "| 8 |" in updated
    assert updated.endswith("|\n")  # one newline ends the file, as it ended before
    appended = replace_section("# Benchmarks\n", "executors", {"executors": result}, "cmd")
    assert "## executors:" in appended
    with pytest.raises(ValueError, match="not a bundle"):
        run_executors(tiny, repeats=1)


def test_single_runs_a_bundle_on_its_executor(tiny_bundle: Path) -> None:
    result = SCENARIOS["single"](ss.load(tiny_bundle), repeats=1)
    assert [row["prompt_tokens"] for row in result["rows"]] == [32]  # the tiny context is 256
    assert "decode_tok_s_int8" not in result["rows"][0]
    assert result["rows"][0]["decode_tok_s"]["median"] > 0
