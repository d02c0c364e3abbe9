"""Workload presets: the config each yields for a budget and a model, and that it serves its
workload shape; explicit settings override; `slotserve plan --preset` explains itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.cli import main
from slotserve.kv.config import KVConfig
from slotserve.plan import CapacityPlan, parse_bytes
from slotserve.presets import PRESETS, choose_preset, estimated_weight_bytes
from tests.engine.conftest import RecordingExecutor
from tests.engine.test_release_checklist import wait_until

BUDGET = "1GiB"


def planned(config: ss.EngineConfig, model: ss.Model) -> CapacityPlan:
    return config.plan(model.info, model.weight_bytes)


def grown(config: ss.EngineConfig, model: ss.Model, **kv: int) -> CapacityPlan:
    return planned(config, model).with_kv(**kv)


# -- the config each preset yields for the bundled model and 1 GiB ---------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_follows_its_row_and_fits_the_budget(name: str, bundled: ss.Model) -> None:
    config = ss.EngineConfig.preset(name, bundled, BUDGET)
    row = PRESETS[name]
    assert {key: getattr(config, key) for key in row.settings()} == row.settings()
    assert config.memory_budget == parse_bytes(BUDGET)
    assert planned(config, bundled).fits


@pytest.mark.parametrize("name", ["chat", "chat+background", "voice", "shared-prompt"])
def test_max_context_is_the_largest_the_budget_allows(name: str, bundled: ss.Model) -> None:
    config = ss.EngineConfig.preset(name, bundled, BUDGET)
    step = config.block_size if config.kv_layout == "cell" else 1
    assert config.max_context % step == 0
    assert config.max_context < bundled.info.max_context
    assert not grown(config, bundled, max_context=config.max_context + step).fits


def test_bundled_figures_at_one_gib(bundled: ss.Model) -> None:
    """The table at 1 GiB for the bundled model (fp32 weights, fp32 KV), pinned."""
    chosen = {name: ss.EngineConfig.preset(name, bundled, BUDGET) for name in PRESETS}
    assert {n: (c.kv_layout, c.max_seqs, c.max_context) for n, c in chosen.items()} == {
        "chat": ("flat", 1, 7704),
        "chat+background": ("cell", 4, 2432),
        "voice": ("cell", 4, 2432),
        "document-agent": ("ring", 1, 8192),
        "shared-prompt": ("cell", 8, 1264),
    }
    agent = chosen["document-agent"]
    assert (agent.ring_window, agent.sinks) == (7483, 4)
    assert not grown(agent, bundled, ring_window=agent.ring_window + 1).fits
    assert chosen["shared-prompt"].policy == "fifo"
    assert chosen["chat+background"].background_min_share > 0


def test_overrides_win_and_the_context_is_sized_around_them(bundled: ss.Model) -> None:
    alone = ss.EngineConfig.preset("chat", bundled, BUDGET)
    two = ss.EngineConfig.preset("chat", bundled, BUDGET, max_seqs=2, kv_dtype="int8")
    assert (two.max_seqs, two.kv_dtype, two.kv_layout) == (2, "int8", "flat")
    assert planned(two, bundled).fits
    fixed = ss.EngineConfig.preset("voice", bundled, BUDGET, max_context=512)
    assert fixed.max_context == 512 and fixed.max_seqs == 4
    assert alone.max_context < bundled.info.max_context
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        ss.EngineConfig.preset("chat", bundled, BUDGET, max_sessions=2)


def test_bad_names_and_budgets_are_clear_errors(bundled: ss.Model) -> None:
    with pytest.raises(ValueError, match="not one of chat, chat\\+background"):
        ss.EngineConfig.preset("podcast", bundled, BUDGET)
    with pytest.raises(ss.PlanError, match=r"does not fit the budget 256\.00 MiB"):
        ss.EngineConfig.preset("chat", bundled, "256MiB")


def test_model_info_alone_estimates_fp32_weights(bundled: ss.Model, tiny: ss.Model) -> None:
    for model in (bundled, tiny):
        assert estimated_weight_bytes(model.info) == model.weight_bytes
    assert ss.EngineConfig.preset("chat", bundled.info, BUDGET) == ss.EngineConfig.preset(
        "chat", bundled, BUDGET
    )


def test_shared_prompt_says_the_prefix_cache_is_unavailable(
    bundled: ss.Model, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        choice = choose_preset("shared-prompt", bundled.info, bundled.weight_bytes, BUDGET)
    assert "prefix cache is unavailable" in caplog.text
    assert any("prefix cache is unavailable" in line for line in choice.lines())


# -- each preset serves its workload shape (tiny model, small budgets) ------------------


def tiny_budget(model: ss.Model, layout: str, max_seqs: int, context: int, **kv: int) -> int:
    """A budget that holds ``max_seqs`` sessions of ``context`` positions (and no more)."""
    config = KVConfig(layout=layout, max_seqs=max_seqs, max_context=context, **kv)
    return CapacityPlan(model.info, config, model.weight_bytes, 512).worst_case_bytes


def test_chat_serves_one_conversation_and_queues_the_next_turn(tiny: ss.Model) -> None:
    config = ss.EngineConfig.preset("chat", tiny, tiny_budget(tiny, "flat", 1, 192))
    assert (config.max_seqs, config.max_context, config.queue_depth) == (1, 192, 1)
    with ss.Engine(tiny, config) as engine:
        params = ss.SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
        first = engine.submit(list(range(3, 100)), params, "interactive")
        second = engine.submit([5, 6, 7], params, "interactive")  # waits for the first
        assert first.result().reason == "length" and second.result().reason == "length"
        assert second.finished is not None and second.finished.timings.queue_time > 0
        engine.check_integrity()


def test_chat_background_never_co_batches_and_never_starves(tiny: ss.Model) -> None:
    config = ss.EngineConfig.preset("chat+background", tiny, tiny_budget(tiny, "cell", 4, 128))
    assert (config.kv_layout, config.policy, config.max_context) == ("cell", "isolate", 128)
    executor = RecordingExecutor(tiny)
    long = ss.SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    with ss.Engine(tiny, config, executor=executor) as engine:
        job = engine.submit(list(range(3, 20)), long, "background")
        next(iter(job))
        chat = engine.submit([5, 6, 7], long, "interactive")
        chat.result()
        classes = {job.request_id: "background", chat.request_id: "interactive"}
        for step in executor.steps:
            assert len({classes[session] for session, _ in step}) == 1, step
        chat_span = [i for i, step in enumerate(executor.steps) if step[0][0] == chat.request_id]
        during = executor.steps[chat_span[0] : chat_span[-1]]
        background = sum(step[0][0] == job.request_id for step in during)
        assert background >= 0.5 * config.background_min_share * len(during)  # not starved
        job.cancel(wait=True)
        engine.check_integrity()


def test_voice_fifty_barge_ins_leave_no_leak(tiny: ss.Model) -> None:
    config = ss.EngineConfig.preset("voice", tiny, tiny_budget(tiny, "cell", 4, 128))
    assert (config.kv_layout, config.max_seqs, config.queue_timeout_s) == ("cell", 4, 2.0)
    params = ss.SamplingParams(temperature=0.7, max_new_tokens=60, ignore_eos=True, seed=1)
    with ss.Engine(tiny, config) as engine:
        speaking = engine.submit([5, 6, 7], params, "interactive")
        for turn in range(50):
            for n, _ in enumerate(speaking, 1):
                if n >= 1 + turn % 4:
                    break
            speaking.cancel()  # barge-in: the new turn is submitted at once, not after
            speaking = engine.submit([8, 9, 10 + turn], params, "interactive")
        speaking.cancel(wait=True)
        wait_until(lambda: engine.stats().slots_in_use == 0)
        stats = engine.stats()
        assert (stats.slots_in_use, stats.kv_blocks_used, stats.queue_len) == (0, 0, 0)
        assert stats.cancellations == 51 and stats.refusals == {}
        engine.check_integrity()


def test_document_agent_serves_a_prompt_longer_than_its_window(tiny: ss.Model) -> None:
    budget = tiny_budget(tiny, "ring", 1, 256, ring_window=80, sinks=4)
    config = ss.EngineConfig.preset("document-agent", tiny, budget)
    assert (config.kv_layout, config.max_context, config.sinks) == ("ring", 256, 4)
    assert 80 <= config.ring_window < 100
    document = [3 + i % 250 for i in range(200)]  # longer than the window
    params = ss.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    with ss.Engine(tiny, config) as engine:
        finished = engine.submit(document, params, "normal").result()
        assert finished.reason == "length" and len(finished.tokens) == 40
        engine.check_integrity()
        assert engine.stats().kv_blocks_used == 0


def test_shared_prompt_admits_a_burst_in_batches(tiny: ss.Model) -> None:
    config = ss.EngineConfig.preset("shared-prompt", tiny, tiny_budget(tiny, "cell", 8, 64))
    assert (config.policy, config.max_seqs, config.queue_depth) == ("fifo", 8, 32)
    executor = RecordingExecutor(tiny)
    shared = list(range(3, 30))
    params = ss.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    with ss.Engine(tiny, config, executor=executor) as engine:
        handles = [engine.submit([*shared, 40 + i], params) for i in range(12)]
        assert all(h.result().reason == "length" for h in handles)
        assert max(len(step) for step in executor.steps) == 8  # co-batched, slot ceiling
        assert engine.stats().refusals == {}


# -- the command line --------------------------------------------------------------------


def test_plan_preset_prints_one_line_per_decision(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_dirs["llama"])
    assert main(["plan", "--model", model, "--preset", "voice", "--memory-budget", "8MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("preset voice: short sessions, frequent cancellation")
    decided = [line for line in lines if line.startswith("  [voice] ")]
    settings = {line.split()[1] for line in decided}
    assert {"kv_layout", "max_seqs", "max_context", "policy", "queue_depth"} <= settings
    assert {"queue_timeout_s", "background_min_share", "ring_window", "sinks"} <= settings


def test_plan_preset_flags_override(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_dirs["llama"])
    argv = ["plan", "--model", model, "--preset", "voice", "--memory-budget", "8MiB"]
    assert main([*argv, "--max-seqs", "2", "--policy", "fifo", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["max_seqs"], report["layout"]) == (2, "cell")
    decisions = {d["setting"]: d for d in report["preset"]["decisions"]}
    assert decisions["policy"]["value"] == "fifo" and decisions["policy"]["source"] == "flag"
    assert decisions["max_context"]["source"] in ("sized", "preset")
