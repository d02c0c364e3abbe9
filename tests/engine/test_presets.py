"""Workload presets: the config each yields for a budget and a model (sized with the model's
own weight bytes, whatever their format), that it fits that budget and serves its workload
shape (the shared-prompt preset with its prefix cache on); explicit settings override;
`slotserve plan --preset` explains itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.cli import main
from slotserve.engine.presets import PRESETS, PresetRow, choose_preset
from slotserve.engine.probe import ledger_for
from slotserve.executor import executor_for
from slotserve.kv.config import KVConfig
from slotserve.memory import MemoryLedger, MemoryMap, parse_bytes
from slotserve.plan import CapacityPlan
from tests.engine.conftest import RecordingExecutor
from tests.engine.test_release_checklist import wait_until

# Small enough that the budget, not the model's 8,192 positions, bounds every preset's
# context with the default fp16 KV on the fp32 weights (at 1 GiB chat fits the whole context).
BUDGET = "700MiB"


def planned(config: ss.EngineConfig, model: ss.Model) -> CapacityPlan:
    """The plan the engine checks (its ledger; its activations for the attention it runs)."""
    ledger = ledger_for(model, config, executor_for(model))
    kernel = config.kernels == "auto" and model.kernels.attention is not None
    return config.plan(model.info, ledger, attention_kernel=kernel)


def grown(config: ss.EngineConfig, model: ss.Model, **kv: int) -> CapacityPlan:
    return planned(config, model).with_kv(**kv)


@pytest.fixture(scope="module")
def blocks() -> ss.Model:
    """The bundled model as its GGUF file's blocks (what ``load`` gives by default)."""
    return ss.load("bundled", weights="gguf", progress=False)


# -- the config each preset yields for the bundled model and 1 GiB ---------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_follows_its_row_and_fits_the_budget(name: str, bundled: ss.Model) -> None:
    config = ss.preset_config(name, bundled, BUDGET)
    row = PRESETS[name]
    assert {key: getattr(config, key) for key in row.overrides} == dict(row.overrides)
    assert config.memory_budget == parse_bytes(BUDGET)
    assert planned(config, bundled).fits


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_rest_is_engine_config_defaults(name: str, bundled: ss.Model) -> None:
    """A preset is overrides: every field neither the row nor the budget decides keeps
    `EngineConfig`'s own default."""
    config = ss.preset_config(name, bundled, BUDGET)
    decided = {*PRESETS[name].overrides, "max_context", "ring_window", "prefix_cache_bytes"}
    for f in dataclasses.fields(ss.EngineConfig):
        if f.name not in decided | {"memory_budget"}:
            assert getattr(config, f.name) == f.default, f.name


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("budget", ["256MiB", "1GiB"])
def test_a_preset_config_fits_the_budget_it_was_sized_for(
    name: str, budget: str, blocks: ss.Model
) -> None:
    """The engine's own plan of the config (what `Engine` checks at start) fits the
    budget, with the weight bytes of the format the model was loaded in."""
    choice = choose_preset(name, blocks, budget)
    plan = planned(choice.config, blocks)
    assert plan.memory_budget == parse_bytes(budget) and plan.fits
    plan.check()
    assert plan.arenas["weights"] == blocks.weight_bytes
    sized = {d.setting: d for d in choice.decisions if d.source == "sized"}
    assert "max_context" in sized or "ring_window" in sized
    assert {d.setting for d in choice.decisions} >= {"max_context", "ring_window"}


def test_a_memory_map_sizes_like_a_budget(tiny: ss.Model) -> None:
    weights = tiny.weight_bytes
    kv = 1 << 19  # less than 4 sessions at the tiny model's whole context
    # Activations with room over the plan's (its heap term alone is `HEAP_REFAULT`): the
    # KV pool is the arena the preset sizes to the map.
    memory_map = MemoryMap.of(weights=weights, kv=kv, activations=16 << 20)
    config = ss.preset_config("voice", tiny, None, memory_map=memory_map)
    assert config.memory_map == memory_map and config.memory_budget is None
    plan = planned(config, tiny)
    assert plan.fits and plan.kv_bytes <= kv
    assert not grown(config, tiny, max_context=config.max_context + config.block_size).fits


@pytest.mark.parametrize("name", ["chat", "chat+background", "voice", "shared-prompt"])
def test_max_context_is_the_largest_the_budget_allows(name: str, bundled: ss.Model) -> None:
    config = ss.preset_config(name, bundled, BUDGET)
    step = config.block_size if config.kv_layout == "cell" else 1
    assert config.max_context % step == 0
    assert config.max_context < bundled.info.max_context
    assert not grown(config, bundled, max_context=config.max_context + step).fits


def test_bundled_figures_at_one_gib(bundled: ss.Model) -> None:
    """The table at 700 MiB for the bundled model (fp32 weights, fp16 KV: the default),
    pinned. The activations are planned for the compiled attention the engine runs, which
    materialises no score block, and for the costliest sampling: on torch's attention's
    plan, without the sampling, the table was chat 3693, chat+background 1408, voice 1840,
    document-agent 7319 and shared-prompt 768."""
    chosen = {name: ss.preset_config(name, bundled, BUDGET) for name in PRESETS}
    assert {n: (c.kv_layout, c.max_seqs, c.max_context) for n, c in chosen.items()} == {
        "chat": ("flat", 1, 6920),
        "chat+background": ("cell", 4, 1728),
        "voice": ("cell", 4, 1920),  # its 64-token steps plan fewer activation bytes
        "document-agent": ("ring", 1, 8192),  # the model's whole context
        "shared-prompt": ("cell", 8, 848),
    }
    assert all(c.kv_dtype == "fp16" for c in chosen.values())
    agent = chosen["document-agent"]
    assert (agent.ring_window, agent.sinks) == (6891, 4)  # the largest window that fits
    assert not grown(agent, bundled, ring_window=agent.ring_window + 1).fits
    assert chosen["shared-prompt"].policy == "fifo"
    assert chosen["chat+background"].background_min_share > 0


def test_sizing_uses_the_loaded_weights_not_an_fp32_estimate(
    bundled: ss.Model, blocks: ss.Model
) -> None:
    """The same model as GGUF blocks holds a fraction of its fp32 bytes: the preset gives
    the difference to the KV pool, and each config fits only with its own weights."""
    assert blocks.weight_bytes < bundled.weight_bytes
    for name in ("chat+background", "shared-prompt"):
        fp32 = ss.preset_config(name, bundled, "768MiB")
        quantised = ss.preset_config(name, blocks, "768MiB")
        assert quantised.max_context > fp32.max_context
        assert planned(quantised, blocks).fits and not planned(quantised, bundled).fits


def test_overrides_win_and_the_context_is_sized_around_them(bundled: ss.Model) -> None:
    alone = ss.preset_config("chat", bundled, BUDGET)
    two = ss.preset_config("chat", bundled, BUDGET, max_seqs=2, kv_dtype="int8")
    assert (two.max_seqs, two.kv_dtype, two.kv_layout) == (2, "int8", "flat")
    assert planned(two, bundled).fits
    fixed = ss.preset_config("voice", bundled, BUDGET, max_context=512)
    assert fixed.max_context == 512 and fixed.max_seqs == 4
    assert alone.max_context < bundled.info.max_context
    off = ss.preset_config("shared-prompt", bundled, BUDGET, prefix_cache_bytes=0)
    assert off.prefix_cache_budget == 0
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        ss.preset_config("chat", bundled, BUDGET, max_sessions=2)


def test_bad_names_budgets_and_rows_are_clear_errors(bundled: ss.Model) -> None:
    with pytest.raises(ValueError, match="not one of chat, chat\\+background"):
        ss.preset_config("podcast", bundled, BUDGET)
    with pytest.raises(ss.PlanError, match=r"does not fit the budget 256\.00 MiB"):
        ss.preset_config("chat", bundled, "256MiB")
    with pytest.raises(ValueError, match=r"\['max_context'\] cannot be a row's override"):
        PresetRow("chat", "shape", "admission", {"max_context": 512})
    with pytest.raises(ValueError, match="needs kv_layout='cell', not 'flat'"):
        PresetRow("chat", "shape", "admission", {"kv_layout": "flat"}, prefix_cache_share=0.5)
    with pytest.raises(ValueError, match="policy='lifo' is not one of"):
        PresetRow("chat", "shape", "admission", {"policy": "lifo"})


def test_shared_prompt_sizes_its_prefix_cache_as_a_share_of_the_pool(bundled: ss.Model) -> None:
    choice = choose_preset("shared-prompt", bundled, BUDGET)
    plan = planned(choice.config, bundled)
    prefix = plan.prefix_cache
    assert prefix is not None and choice.config.prefix_cache_budget == prefix["pinnable_bytes"]
    assert prefix["blocks"] == int(0.25 * plan.kv.total_blocks)
    assert prefix["pool_fraction"] == pytest.approx(0.25, abs=1 / plan.kv.total_blocks)
    (decision,) = [d for d in choice.decisions if d.setting == "prefix_cache_bytes"]
    assert decision.source == "sized" and "25% of the KV pool" in decision.why
    line = next(line for line in choice.lines() if " prefix_cache_bytes = " in line)
    assert f"{prefix['blocks']} blocks" in line and "unavailable" not in line
    for name in set(PRESETS) - {"shared-prompt", "chat"}:
        assert ss.preset_config(name, bundled, BUDGET).prefix_cache_budget == 0


def test_chat_parks_its_slot_for_the_next_turn_and_plans_no_copies(bundled: ss.Model) -> None:
    """The one-conversation row (flat, one slot) keeps its history: the cache is on, its
    snapshots are the parked slot, and the plan adds nothing for them."""
    choice = choose_preset("chat", bundled, BUDGET)
    plan = planned(choice.config, bundled)
    prefix = plan.prefix_cache
    assert prefix is not None and prefix["parks_slots"]
    assert (prefix["copy_bytes"], prefix["ring_copy_bytes"], prefix["pinnable_bytes"]) == (0, 0, 0)
    assert choice.config.prefix_cache_budget == plan.bytes_per_session
    assert plan.arenas["kv"] == plan.kv_bytes
    (decision,) = [d for d in choice.decisions if d.setting == "prefix_cache_bytes"]
    assert decision.source == "sized" and "parked" in decision.why


# -- each preset serves its workload shape (tiny model, small budgets) ------------------


def tiny_budget(model: ss.Model, layout: str, max_seqs: int, context: int, **kv: int) -> int:
    """A budget that holds ``max_seqs`` sessions of ``context`` positions (and no more), with
    the activations of the attention the engine runs on ``model``."""
    config = KVConfig(layout=layout, max_seqs=max_seqs, max_context=context, **kv)
    kernel = model.kernels.attention is not None
    weights = MemoryLedger()
    weights.add("weights", model.weight_bytes, "computed", "the test")
    plan = CapacityPlan(model.info, config, weights, 512, attention_kernel=kernel)
    return plan.worst_case_bytes


def test_chat_serves_one_conversation_and_queues_the_next_turn(tiny: ss.Model) -> None:
    config = ss.preset_config("chat", tiny, tiny_budget(tiny, "flat", 1, 192))
    assert (config.max_seqs, config.max_context, config.queue_depth) == (1, 192, 1)
    with ss.Engine(tiny, config) as engine:
        params = ss.SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
        first = engine.submit(list(range(3, 100)), params, "interactive")
        second = engine.submit([5, 6, 7], params, "interactive")  # waits for the first
        assert first.result().reason == "length" and second.result().reason == "length"
        assert second.finished is not None and second.finished.timings.queue_time > 0
        engine.check_integrity()


def test_chat_background_never_co_batches_and_never_starves(tiny: ss.Model) -> None:
    config = ss.preset_config("chat+background", tiny, tiny_budget(tiny, "cell", 4, 128))
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
    config = ss.preset_config("voice", tiny, tiny_budget(tiny, "cell", 4, 128))
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
    config = ss.preset_config("document-agent", tiny, budget)
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
    config = ss.preset_config("shared-prompt", tiny, tiny_budget(tiny, "cell", 8, 64))
    assert (config.policy, config.max_seqs, config.queue_depth) == ("fifo", 8, 32)
    executor = RecordingExecutor(tiny)
    shared = list(range(3, 30))
    params = ss.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    with ss.Engine(tiny, config, executor=executor) as engine:
        handles = [engine.submit([*shared, 40 + i], params) for i in range(12)]
        assert all(h.result().reason == "length" for h in handles)
        assert max(len(step) for step in executor.steps) == 8  # co-batched, slot ceiling
        assert engine.stats().refusals == {}


def test_shared_prompt_restores_the_shared_prefix_from_its_cache(tiny: ss.Model) -> None:
    config = ss.preset_config("shared-prompt", tiny, tiny_budget(tiny, "cell", 8, 64))
    assert config.prefix_cache_budget > 0
    shared = list(range(3, 35))  # two whole blocks of 16
    params = ss.SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    with ss.Engine(tiny, config) as engine:
        assert engine.prefix is not None
        cache = engine.stats().prefix
        assert cache is not None and cache.budget_bytes == config.prefix_cache_budget
        finals = [engine.submit([*shared, 40 + i], params).result() for i in range(4)]
        assert [f.usage.cached_tokens >= len(shared) for f in finals] == [False, True, True, True]
        stats = engine.stats().prefix
        assert stats is not None
        assert stats.hits == 3 and stats.tokens_restored >= 3 * len(shared)
        assert stats.bytes_pinned <= config.prefix_cache_budget
        engine.check_integrity()


# -- the command line --------------------------------------------------------------------

GRAMMARS_4MIB = ["--grammar-max-bytes", "4MiB", "--grammar-cache-bytes", "4MiB"]


def test_plan_preset_prints_one_line_per_decision(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_dirs["llama"])
    argv = ["plan", "--model", model, "--preset", "voice", "--memory-budget", "32MiB"]
    argv += GRAMMARS_4MIB  # plan counts serve's grammar arenas (128 MiB unless told)
    assert main([*argv, "--budget-scope", "model"]) == 0  # the model's arenas and grammars
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
    argv = ["plan", "--model", model, "--preset", "voice", "--memory-budget", "32MiB"]
    argv += ["--budget-scope", "model", *GRAMMARS_4MIB]  # the model's arenas and grammars
    assert main([*argv, "--max-seqs", "2", "--policy", "fifo", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["max_seqs"], report["layout"]) == (2, "cell")
    decisions = {d["setting"]: d for d in report["preset"]["decisions"]}
    assert decisions["policy"]["value"] == "fifo" and decisions["policy"]["source"] == "flag"
    assert decisions["max_context"]["source"] in ("sized", "preset")
