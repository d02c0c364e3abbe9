"""`slotserve bench structured`, its tool-call case, on a tiny random model: it runs at
batch 1 and 8 and reports the step time under the call grammar and free; every reply it
times is one whole call whose arguments validate against their function's schema; and its
report section is written (or says why it was skipped)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

import slotserve as ss
from slotserve.bench.report import markdown_report
from slotserve.bench.structured import SAMPLING
from slotserve.bench.structured_tools import TOOLS, run_tool_calls, tool_calls_section
from slotserve.testing import write_tiny_hf_dir


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    """The tiny Llama with room for the case's prompt: its tokenizer is one token a byte,
    so the tools' instruction alone is about a thousand tokens."""
    path = write_tiny_hf_dir(tmp_path_factory.mktemp("tiny-long") / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (path / "config.json").write_text(json.dumps(config))
    return ss.load(path)


@pytest.fixture(scope="module")
def result(long_tiny: ss.Model) -> dict[str, Any]:
    return run_tool_calls(long_tiny, SAMPLING, repeats=1)


def test_the_case_reports_both_step_times_at_batch_1_and_8(result: dict[str, Any]) -> None:
    assert result["syntax"] == "generic"  # the tiny template takes no tools
    assert result["tool_choice"] == "required"
    assert [row["batch"] for row in result["rows"]] == [1, 8]
    for row in result["rows"]:
        for side in ("free", "tools"):
            median = row[f"step_ms_{side}"]["median"]
            assert 0 < median <= row[f"step_p99_ms_{side}"]["median"]
        assert row["step_ratio"]["median"] > 0 and row["step_p99_ratio"]["median"] > 0
    assert result["step_ratio_batch_1"] > 0 and result["step_ratio_batch_8"] > 0
    assert result["grammar_compile_s"] > 0


def test_every_timed_reply_is_one_call_that_validates(result: dict[str, Any]) -> None:
    assert result["replies"] == 1 + 8  # one repeat at each batch size
    assert len(result["calls"]) == result["replies"]  # each reply is one whole call
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in result["calls"]:
        assert call["name"] in schemas
        jsonschema.validate(
            call["arguments"], schemas[call["name"]], format_checker=jsonschema.FormatChecker()
        )


def test_the_report_has_the_tool_call_table(result: dict[str, Any]) -> None:
    structured = {
        "decode_tokens": 32,
        "repeats": 1,
        "grammar_first_compile_s": 0.1,
        "grammar_compile_s": 0.01,
        "rows": [],
        "tool_calls": result,
    }
    report = markdown_report({"structured": structured}, "slotserve bench structured", {})
    lines = report.splitlines()
    heading = "### structured: tool calls (the call grammar) vs free text, per decode step"
    assert heading in lines
    header = (
        "| batch | free step ms | call grammar step ms | ratio | free p99 ms "
        "| call grammar p99 ms | p99 ratio |"
    )
    table = lines.index(header)
    assert [line.split(" | ")[0] for line in lines[table + 2 : table + 4]] == ["| 1", "| 8"]
    assert f"{len(result['calls'])} of {result['replies']}." in report


def test_a_context_too_short_for_the_prompt_is_skipped(tiny: ss.Model) -> None:
    skipped = run_tool_calls(tiny, SAMPLING, repeats=1)
    assert "exceeds the model's max_context=256" in skipped["skipped"]
    assert tool_calls_section(skipped)[2].startswith("Skipped: its prompt (")
