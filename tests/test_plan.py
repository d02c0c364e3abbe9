"""CapacityPlan: honest bytes (planned = measured), fit, and the levers in PlanError."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotserve as ss
from slotserve.artifact import model_path
from slotserve.kv import KVConfig, KVPool
from slotserve.memory import MemoryLedger, MemoryMap, parse_bytes
from slotserve.memory.ledger import How
from slotserve.plan import CapacityPlan

INFO = ss.ModelInfo(
    arch="llama",
    n_layers=4,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    vocab_size=300,
    max_context=512,
)
MIXED = dataclasses.replace(INFO, sliding_window=(None, 32, None, 32))


def ledger(**arenas: int) -> MemoryLedger:
    """A ledger of the given arenas, computed."""
    held = MemoryLedger()
    for name, nbytes in arenas.items():
        held.add(name, nbytes, "computed", "the test")
    return held


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1GiB", 2**30),
        ("1.5GiB", 3 * 2**29),
        ("512MB", 512 * 10**6),
        ("1000", 1000),
        (" 2 mib ", 2 * 2**20),
        ("1k", 1024),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "1.2.3GB", "5 parsecs", "", "-1GB"])
def test_unparseable_budget_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        parse_bytes(text)


CONFIGS = [
    KVConfig(layout="flat", max_seqs=3, max_context=256),
    KVConfig(layout="cell", max_seqs=3, max_context=256, block_size=16),
    KVConfig(layout="cell", max_seqs=3, max_context=256, block_size=16, num_blocks=20),
    KVConfig(layout="ring", max_seqs=3, max_context=256, ring_window=64, sinks=4),
    KVConfig(layout="flat", max_seqs=2, max_context=256, dtype="int8"),
    KVConfig(layout="cell", max_seqs=2, max_context=256, dtype="fp16"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("info", [INFO, MIXED], ids=["full", "mixed"])
def test_planned_kv_bytes_equal_measured_pool_bytes(config: KVConfig, info: ss.ModelInfo) -> None:
    plan = CapacityPlan(info, config)
    assert KVPool(info, config).nbytes == plan.kv_bytes


def test_planned_weights_equal_the_loaded_model(bundled: ss.Model) -> None:
    config = KVConfig(layout="cell", max_seqs=2, max_context=256)
    plan = CapacityPlan(bundled.info, config, ledger(weights=bundled.weight_bytes))
    assert plan.arenas["weights"] == sum(t.nbytes for t in _weight_tensors(bundled))
    assert KVPool(bundled.info, config).nbytes == plan.arenas["kv"]


def _weight_tensors(model: ss.Model) -> list[object]:
    w = model.weights
    tensors = [w.embed, w.norm]
    for layer in w.layers:
        tensors += [
            layer.attn_norm,
            layer.mlp_norm,
            layer.qkv.weight,
            layer.o.weight,  # type: ignore[attr-defined]
            layer.gate_up.weight,
            layer.down.weight,
        ]  # type: ignore[attr-defined]
    return tensors


def test_int8_plan_is_under_30_percent_of_fp32() -> None:
    fp32 = CapacityPlan(
        ss.ModelInfo(**{**dataclasses.asdict(INFO), "rope": INFO.rope, "head_dim": 64}),
        KVConfig(layout="cell", max_seqs=4, max_context=256, dtype="fp32"),
    )
    int8 = fp32.with_kv(dtype="int8")
    assert int8.kv_bytes <= 0.30 * fp32.kv_bytes


def test_plan_that_does_not_fit_names_the_levers() -> None:
    config = KVConfig(layout="cell", max_seqs=8, max_context=512, block_size=16)
    base = CapacityPlan(INFO, config, ledger(weights=10**6))
    arenas = base.arenas
    budget = arenas["weights"] + arenas["activations"] + int(3.5 * base.bytes_per_session)
    plan = dataclasses.replace(base, memory_budget=budget)
    assert not plan.fits
    with pytest.raises(ss.PlanError) as err:
        plan.check()
    seqs = int(re.search(r"max_seqs that fits at max_context=512: (\d+)", str(err.value)).group(1))  # type: ignore[union-attr]
    context = int(re.search(r"max_context that fits at max_seqs=8: (\d+)", str(err.value)).group(1))  # type: ignore[union-attr]
    assert 1 <= seqs < 8 and 16 <= context < 512 and context % 16 == 0
    assert plan.with_kv(max_seqs=seqs).fits and not plan.with_kv(max_seqs=seqs + 1).fits
    assert plan.with_kv(max_context=context).fits
    assert not plan.with_kv(max_context=context + 16).fits


ARENAS = (
    "runtime",
    "tokenizer",
    "weights",
    "methods",
    "grammar_index",
    "grammar_workers",
    "grammars",
    "responses",
    "start",
    "draft_weights",
    "draft_kv",
    "draft_activations",
)


@pytest.mark.parametrize("arena", [*ARENAS, "kv", "activations"])
def test_a_memory_map_is_refused_naming_an_arena_it_leaves_out_or_holds_too_little_of(
    arena: str,
) -> None:
    """Every arena of the plan is checked against the map: one left out is refused naming
    it (never passed), and so is one the map holds one byte too little of."""
    config = KVConfig(layout="flat", max_seqs=2, max_context=256)
    plan = CapacityPlan(INFO, config, ledger(**{name: 1000 + i for i, name in enumerate(ARENAS)}))
    arenas = plan.arenas
    exact = MemoryMap(tuple(arenas.items()))
    assert dataclasses.replace(plan, memory_map=exact).fits
    dataclasses.replace(plan, memory_map=exact).check()
    left_out = MemoryMap(tuple((n, b) for n, b in arenas.items() if n != arena))
    with pytest.raises(ss.PlanError, match=f"no limit for arena '{arena}'"):
        dataclasses.replace(plan, memory_map=left_out).check()
    short = MemoryMap(tuple((n, b - (n == arena)) for n, b in arenas.items()))
    tight = dataclasses.replace(plan, memory_map=short)
    assert not tight.fits
    with pytest.raises(ss.PlanError, match=f"arena '{arena}' needs"):
        tight.check()
    with pytest.raises(ValueError, match="not both"):
        CapacityPlan(INFO, config, memory_budget=1, memory_map=exact)


def test_a_memory_map_parses_named_arenas_and_refuses_the_old_positional_form() -> None:
    parsed = MemoryMap.parse("runtime=300MiB, weights=1GiB,kv=64MiB")
    assert parsed.limit("weights") == 2**30 and parsed.limit("activations") is None
    assert parsed.total == 300 * 2**20 + 2**30 + 64 * 2**20
    with pytest.raises(ValueError, match="ARENA=BYTES"):
        MemoryMap.parse("600MiB,256MiB,128MiB")
    with pytest.raises(ValueError, match="twice"):
        MemoryMap.parse("kv=1MiB,kv=2MiB")


def test_the_ledger_sums_its_entries_and_checks_a_budget() -> None:
    held = ledger(runtime=100, weights=50)
    held.add("runtime", 25, "measured", "a server's start")
    assert held.arenas() == {"runtime": 125, "weights": 50} and held.total == 175
    held.add_peak("load", 400, "a load")
    held.check_integrity()
    held.check(400)
    with pytest.raises(ss.PlanError, match="peak"):
        held.check(399)
    with pytest.raises(ss.PlanError, match="no limit for arena 'weights'"):
        held.check(MemoryMap.of(runtime=1000))
    with pytest.raises(ValueError, match="must be >= 0"):
        held.add("kv", -1, "computed", "a bug")


def test_what_is_measured_into_a_reserve_fills_it_before_it_adds() -> None:
    """A reserved arena holds its reserve until what is measured into it outgrows it; a
    budget sized around the reserve still holds a measurement within it."""
    held = ledger(runtime=100)
    held.add("start", 40, "reserved", "the server's start, once sized")
    assert held.arenas() == {"runtime": 100, "start": 40} and held.total == 140
    held.check(140)
    held.add("start", 25, "measured", "the largest step")
    held.add("start", 15, "measured", "the server's start")
    assert held.total == 140  # 40 measured, within the reserve
    held.check(140)
    held.add("start", 1, "measured", "one byte more")
    assert held.bytes("start") == 41 and held.total == 141
    with pytest.raises(ss.PlanError):
        held.check(140)
    held.check_integrity()


@given(
    st.lists(
        st.tuples(
            st.sampled_from(("runtime", "start", "kv")),
            st.integers(0, 1000),
            st.sampled_from(("measured", "computed", "reserved")),
        ),
        max_size=20,
    )
)
def test_an_arena_is_its_entries_sum_or_its_reserve_after_every_addition(
    additions: list[tuple[str, int, How]],
) -> None:
    held = MemoryLedger()
    for name, nbytes, how in additions:
        held.add(name, nbytes, how, "the test")
        held.check_integrity()
        own = [(b, h) for n, b, h in additions[: len(held.entries)] if n == name]
        expected = max(
            sum(b for b, h in own if h != "reserved"), sum(b for b, h in own if h == "reserved")
        )
        assert held.bytes(name) == expected
        assert held.total == sum(held.arenas().values())
        held.check(held.total)
        if held.total:
            with pytest.raises(ss.PlanError):
                held.check(held.total - 1)


def test_plan_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from slotserve.cli import main

    argv = [
        "plan",
        "--model",
        "bundled",
        "--max-seqs",
        "8",
        "--max-context",
        "4096",
        "--kv-layout",
        "cell",
        "--memory-budget",
        "1GiB",
        "--json",
        "--measure",
    ]
    assert main(argv) == 1  # does not fit: exit status says so
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is False
    assert {
        "fits",
        "arenas",
        "bytes_per_session",
        "worst_case_bytes",
        "max_seqs_that_fit",
        "max_context_that_fits",
    } <= set(report)
    assert report["measured"]["pool_bytes"] == report["arenas"]["kv"]


def test_the_plan_states_what_the_prefix_cache_may_pin() -> None:
    config = KVConfig(layout="cell", max_seqs=2, max_context=256, block_size=16)
    plan = CapacityPlan(INFO, config)
    assert plan.prefix_cache is None and plan.to_dict()["prefix_cache"] is None
    block = plan.kv_bytes // config.total_blocks
    cached = dataclasses.replace(plan, prefix_cache_bytes=5 * block + 1)
    stated = cached.to_dict()["prefix_cache"]
    assert stated["pinnable_bytes"] == 5 * block and stated["blocks"] == 5  # whole blocks
    assert stated["pool_fraction"] == 5 / config.total_blocks
    assert cached.worst_case_bytes == plan.worst_case_bytes  # inside the pool, not beside it
    whole = dataclasses.replace(plan, prefix_cache_bytes=10 * plan.kv_bytes)
    assert whole.to_dict()["prefix_cache"]["pool_fraction"] == 1.0
    engine_plan = ss.EngineConfig(kv_layout="cell", prefix_cache_bytes="1MiB").plan(
        INFO, MemoryLedger()
    )
    assert engine_plan.to_dict()["prefix_cache"]["budget_bytes"] == 1 << 20
    assert stated["ring_copy_bytes"] == 0
    mixed = CapacityPlan(MIXED, config, prefix_cache_bytes=1 << 20)
    pool = KVPool(MIXED, config)
    assert mixed.to_dict()["prefix_cache"]["ring_copy_bytes"] == pool.snapshot_ring_nbytes > 0


def test_a_budget_under_the_runtime_alone_is_refused_with_that_number() -> None:
    config = KVConfig(layout="cell", max_seqs=2, max_context=256, block_size=16)
    runtime = 300 * 2**20
    held = ledger(runtime=runtime, weights=1000)
    plan = CapacityPlan(INFO, config, held, memory_budget=200 * 2**20)
    assert plan.arenas["runtime"] == runtime and plan.worst_case_bytes > runtime
    with pytest.raises(
        ss.PlanError,
        match=r"runtime alone .* 300.00 MiB anonymous, more than the budget 200.00 MiB",
    ):
        plan.check()
    roomy = dataclasses.replace(plan, memory_budget=plan.worst_case_bytes)
    roomy.check()  # the whole plan, runtime included, fits exactly
    assert not dataclasses.replace(roomy, memory_budget=plan.worst_case_bytes - 1).fits
    assert "runtime" not in CapacityPlan(INFO, config, ledger(weights=1000)).arenas


def test_the_engine_plans_the_whole_process_as_measured_at_load(bundled: ss.Model) -> None:
    """The load marks the runtime before the model, the tokenizer and the weights in its
    ledger, measured; the engine's probe adds the first step's state once; a model-scope
    engine plans the model's computed arenas alone."""
    held = bundled.ledger
    assert held is not None
    assert held.bytes("runtime") > 50 * 2**20  # the interpreter and torch at least
    assert {a.how for a in held.entries if a.name in ("tokenizer", "weights")} == {"measured"}
    process = ss.EngineConfig(max_seqs=2, max_context=256, budget_scope="process")
    with ss.Engine(bundled, process) as engine:
        assert engine.ledger is held
        first = [a for a in held.entries if a.source == "first step"]
        assert len(first) == 1 and first[0].bytes < 64 * 2**20
        assert engine.plan.arenas["runtime"] == held.bytes("runtime")
        assert engine.plan.arenas["weights"] >= bundled.weight_bytes
    with ss.Engine(bundled, process):
        assert len([a for a in held.entries if a.source == "first step"]) == 1  # once
    with ss.Engine(bundled, ss.EngineConfig(max_seqs=2, max_context=256)) as engine:
        assert "runtime" not in engine.plan.arenas
        assert engine.plan.arenas["weights"] == bundled.weight_bytes
        assert engine.ledger is not held
    tight = dataclasses.replace(process, memory_budget=held.bytes("runtime") // 2)
    with pytest.raises(ss.PlanError, match="runtime alone"):
        ss.Engine(bundled, tight)


@pytest.mark.parametrize("spec", ["bundled", "gemma3-270m"])
def test_the_planned_weights_are_the_files_size_and_the_tokenizer_is_its_own_arena(
    spec: str, request: pytest.FixtureRequest
) -> None:
    """In a fresh process, as `slotserve plan --model` runs: the weights arena (the load's
    resident growth past the tokenizer, or the weights' own bytes if more) stays within
    1.05x the GGUF file, each tensor in its file's format. The tokenizer built from the
    file's metadata is an arena of its own: counted in the weights, it made the Q4_K_M
    SmolLM2's 1.30x the file (131 MiB for 100.6; 103.4 MiB apart from its 28.4). So is the
    library code the load ran (runtime): in a fresh install, whose just-written libraries
    map in whole page-cache folios, it made the bundled model's 1.43x (CI, 1d6b441)."""
    if spec == "gemma3-270m":
        request.getfixturevalue("gemma3_installed")
    file_bytes = model_path(spec).stat().st_size
    argv = [sys.executable, "-m", "slotserve.cli", "plan", "--model", spec, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    arenas = json.loads(done.stdout)["arenas"]
    assert arenas["weights"] <= 1.05 * file_bytes, (arenas["weights"], file_bytes)
    assert 0 < arenas["tokenizer"] < arenas["weights"]


def test_plan_measure_compares_every_arena_with_its_measurement(tmp_path: Path) -> None:
    """In a fresh process, as `slotserve plan --measure` runs: the KV pool measured equals
    the plan, and the activations of the largest step (every session at max_context) stay
    under the formula and above half of it."""
    argv = [sys.executable, "-m", "slotserve.cli", "plan", "--model", "bundled", "--json"]
    argv += ["--measure", "--max-seqs", "2", "--max-context", "1024", "--kv-layout", "cell"]
    argv += ["--max-batch-tokens", "256", "--prefix-store", str(tmp_path / "store")]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    report = json.loads(done.stdout)
    planned, measured = report["arenas"], report["measured"]["arenas"]
    assert set(measured) == {
        "runtime",
        "tokenizer",
        "weights",
        "grammar_index",
        "grammar_workers",
        "kv",
        "activations",
    }
    assert set(measured) <= set(planned) and measured["tokenizer"] == planned["tokenizer"]
    assert measured["runtime"] == planned["runtime"] and measured["weights"] == planned["weights"]
    assert abs(measured["kv"] - planned["kv"]) <= 0.02 * planned["kv"]
    assert 0.5 * planned["activations"] <= measured["activations"] <= planned["activations"]
    assert report["cancel_bound"]["max_step_tokens"] == 256
    assert report["cancel_bound"]["basis"] == "measured"
    assert report["prefix_store"]["budget_bytes"] == 4 * 2**30
    assert report["budget_scope"] == "process"


def test_a_bundles_planned_method_memory_is_an_arena(tiny_bundle: Path) -> None:
    model = ss.load(tiny_bundle, progress=False)
    planned = model.halves.planned_method_bytes
    # At least one step's activations in fp32 are planned: the embed method's output.
    assert planned >= model.halves.max_step_tokens * model.info.dim * 4  # type: ignore[operator]
    with ss.Engine(model, ss.EngineConfig(max_seqs=2, max_context=128)) as engine:
        assert engine.plan.arenas["methods"] == planned
        assert engine.plan.worst_case_bytes == sum(engine.plan.arenas.values())
    # Within the process's budget the arena is what the probe's largest step left resident
    # (the arenas it wrote, the delegates' scratch for its rows), where that is more.
    process = ss.EngineConfig(max_seqs=2, max_context=128, budget_scope="process")
    with ss.Engine(model, process) as engine:
        (methods,) = [a for a in engine.ledger.entries if a.name == "methods"]
        assert methods.how == "measured" and methods.bytes >= planned


def test_only_a_bundles_probe_runs_its_largest_step(bundled_blocks: ss.Model) -> None:
    plan = ss.EngineConfig(max_seqs=2, max_context=128, budget_scope="process")
    with ss.Engine(bundled_blocks, plan) as engine:
        assert "methods" not in engine.plan.arenas


def test_a_load_runs_no_step_and_the_probe_counts_the_first_steps_state_as_runtime() -> None:
    """In a fresh process: the load runs no step (its ledger has no first step), and the
    first engine's probe measures the first step's one-time state (thread pools, lazy
    tables) into the runtime arena."""
    probe = "import slotserve as ss; m = ss.load('bundled', progress=False)\n"
    probe += "assert not m.ledger.has('runtime', 'first step')\n"
    probe += "e = ss.Engine(m, ss.EngineConfig(budget_scope='process', max_context=256))\n"
    probe += "print(sum(a.bytes for a in m.ledger.entries if a.source == 'first step'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert 0 < int(done.stdout.split()[-1]) < 64 * 2**20
