"""``slotserve bench memory``: a real server driven to its worst case, and the target of
issue 27 — at the worst case the server's peak RSS is at most the plan's total and within
10% of it, on the bundled model and on a bundle (the tiny Llama's, on ExecuTorch).

The worst case (`slotserve.bench.worst_case`): a short chat turn and completion, distinct
prompts until the prefix cache's snapshots fill its budget, ``max_seqs`` streams at once,
every session at ``max_context``, the concurrent prefill in the largest steps
(``max_batch_tokens``), with structured requests beside it from its start (the first builds
the grammar compiler's index during the largest steps) filling the grammars arena (a 4 MiB
one, the least a grammar needs, so that it does not dominate); then the worst case again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.bench.memory import GRAMMAR_FLAGS, server_flags
from slotserve.bench.report import markdown_report, replace_section
from slotserve.bench.worst_case import PHASES, arena_rows, run_worst_case
from slotserve.memory import format_bytes
from slotserve.testing import TINY_VOCAB

TARGET_FLAGS = (
    *("--max-seqs", "2", "--max-context", "1024", "--kv-layout", "cell"),
    *("--grammar-max-bytes", "4MiB", "--grammar-cache-bytes", "4MiB"),
)
BUNDLED_VOCAB = 49152  # SmolLM2's; the prompts' ids are drawn below it


class PlanMissed(AssertionError):
    """The issue's target missed: the peak over the plan's total, or under 90% of it."""


@pytest.fixture(scope="module")
def worst_case() -> dict[str, Any]:
    """The bundled model's server at 2 slots x 1,024 tokens, driven to its worst case
    without filling the stored responses: a whole context's snapshot is over this prefix
    cache's budget, so each of the store's few hundred requests would prefill its context
    (the tiny bundle's test below fills its store)."""
    return run_worst_case("bundled", BUNDLED_VOCAB, TARGET_FLAGS, responses=False)


def test_the_driver_reaches_the_worst_case(worst_case: dict[str, Any]) -> None:
    """Every phase ran as planned: the plan is the server's, the grammars were compiled, the
    prefix cache filled its budget, both sessions ran to max_context."""
    plan = worst_case["plan"]
    assert (plan["max_seqs"], plan["max_context"], plan["layout"]) == (2, 1024, "cell")
    assert plan["arenas"]["grammars"] == 4 * 2**20  # serve's grammars arena is in its plan
    assert plan["worst_case_bytes"] == sum(plan["arenas"].values())
    requests = worst_case["requests"]
    # Two rounds of 2 streams: the first in serving (the structured requests beside it), one
    # more with the grammars held.
    assert (requests["first request"], requests["grammars"], requests["worst case"]) == (2, 4, 4)
    prefix = worst_case["prefix"]
    assert prefix["bytes_pinned"] > prefix["budget_bytes"] // 2 and prefix["evictions"] > 0
    assert list(worst_case["phases"]) == list(PHASES)
    ready = worst_case["phases"]["ready"]["anonymous"]
    # At ready the process holds its runtime and its weights: the KV pool's pages become
    # resident as sessions write them, the grammar index at the first structured request,
    # the stored responses as they are stored.
    at_ready = worst_case["arena_rows"][0]
    assert at_ready["span"] == "at ready" and at_ready["measured_bytes"] == ready
    planned = at_ready["planned_bytes"]
    assert abs(ready - planned) <= 0.05 * planned
    assert "responses" not in requests
    assert worst_case["responses"] == {"left_empty": "the driver was told to leave the store empty"}


def check_stored_responses(worst_case: dict[str, Any]) -> None:
    """The store filled until its byte budget or its count bound stopped it."""
    stored, plan = worst_case["responses"], worst_case["plan"]
    assert stored["budget_bytes"] == plan["arenas"]["responses"] and stored["stored"] > 0
    assert worst_case["requests"]["responses"] >= stored["stored"]
    full = stored["held_bytes"] * (stored["stored"] + 1) > stored["budget_bytes"] * stored["stored"]
    assert stored["stored"] == stored["size"] or full


def check_target(worst_case: dict[str, Any]) -> None:
    """The target: peak anonymous bytes <= the plan's total, and within 10% of it. What
    the driver did not fill of the stored responses' budget (an arena of the plan) is left
    out of the total compared: at a short context the store's count bound (256 responses,
    each at most a context's messages) holds less than its byte budget, and the bundled
    model's test leaves it empty."""
    plan = worst_case["plan"]
    stored = worst_case["responses"].get("held_bytes", 0)
    total = plan["worst_case_bytes"] - (plan["arenas"].get("responses", 0) - stored)
    peak = worst_case["peak_anonymous_bytes"]
    spans = "; ".join(
        f"{row['span']}: {format_bytes(row['measured_bytes'])} against "
        f"{format_bytes(row['planned_bytes'])}"
        for row in worst_case["arena_rows"]
    )
    figures = (
        f"peak {format_bytes(peak)}, plan {format_bytes(total)} ({peak / total:.3f}x); {spans}"
    )
    if not 0.9 * total <= peak <= total:
        raise PlanMissed(figures)


def test_worst_case_peak_rss_is_the_plan(worst_case: dict[str, Any]) -> None:
    check_target(worst_case)


def test_worst_case_peak_rss_is_the_plan_on_a_bundle(tiny_bundle: Path) -> None:
    """The same target on an exported bundle on ExecuTorch (the tiny Llama's, at its whole
    256-token context): its plan counts the program's methods and the weights as the
    runtime holds them, measured at load."""
    flags = ("--max-seqs", "2", "--max-context", "256", "--kv-layout", "cell", *GRAMMAR_FLAGS)
    # A quarter of the pool: serve leaves the cache off on a bundle (its restores are not
    # bit-exact), and the worst case fills it.
    flags += ("--prefix-cache", "65536")
    result = run_worst_case(str(tiny_bundle), TINY_VOCAB, flags)
    plan = result["plan"]
    assert plan["arenas"]["methods"] > 0 and plan["arenas"]["weights"] > 0
    assert result["requests"]["worst case"] == 4 and result["prefix"]["evictions"] > 0
    check_stored_responses(result)
    check_target(result)


def test_arena_rows_are_the_phases_against_the_plan() -> None:
    plan: dict[str, Any] = {"arenas": {"runtime": 100, "weights": 50, "kv": 40}}
    plan["arenas"] |= {"activations": 20, "grammars": 4}
    plan["kv_pool_bytes"] = 30
    plan["arenas"] |= {"grammar_workers": 9}
    phases = {
        "ready": {"anonymous": 180, "anonymous_peak": 180, "children_anonymous_peak": 0},
        "serving": {"anonymous": 201, "anonymous_peak": 216, "children_anonymous_peak": 8},
        "worst case": {"anonymous": 202, "anonymous_peak": 215, "children_anonymous_peak": 7},
    }
    rows = [
        (row["span"], row["arenas"], row["planned_bytes"], row["measured_bytes"])
        for row in arena_rows(plan, phases)
    ]
    assert rows == [
        ("at ready", ["runtime", "weights"], 150, 180),
        (
            "serving with the grammars, its peak above ready",
            ["pool", "copies", "activations", "grammars"],
            64,
            36,
        ),
        ("worst case again, its peak above its start", [], 0, 14),
        ("grammar worker processes, their peak", ["grammar_workers"], 9, 8),
    ]


def test_the_memory_section_reports_the_server(worst_case: dict[str, Any], tiny: ss.Model) -> None:
    result = {"max_seqs": 4, "max_context": 2048, "weights_bytes": 1, "layouts": {}}
    result["server"] = worst_case
    report = markdown_report({"memory": result}, "slotserve bench memory", {})
    assert "## memory: a server's peak anonymous memory" in report
    assert format_bytes(worst_case["peak_anonymous_bytes"]) in report
    assert "| the server and its workers, peak | all |" in report
    assert "no stored responses (the driver was told to leave the store empty)" in report
    document = "# Benchmarks\n\n## memory: old\n\nold text\n\n## servers: x\n\nkept\n"
    rewritten = replace_section(document, "memory", {"memory": result}, "slotserve bench memory")
    assert "old text" not in rewritten and "kept" in rewritten
    assert rewritten.count("\n## memory:") == 1
    # The bench's server for a model with a short context keeps to it.
    assert server_flags(tiny)[3] == str(min(2048, tiny.info.max_context))
