"""The plan's measured parts beyond the runtime and the weights (issue 27): the model load's
peak resident set, which the budget must hold too (a `LoadPeakError` naming it below), the
file map's pages dropped as the load copies them out (`slotserve.memory.release_mapped_range`),
and the grammar compiler's tokenizer index, measured in a worker process at a server's start
(the ``grammar_index`` arena)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import slotserve as ss
from slotserve.engine.config import EngineConfig
from slotserve.kv import KVConfig
from slotserve.memory import MemoryLedger, format_bytes, release_mapped_range
from slotserve.plan import CapacityPlan, LoadPeakError
from slotserve.sampling import grammar_index
from slotserve.sampling.grammar import GrammarCompiler, GrammarConfig, GrammarError
from slotserve.sampling.grammar_index import prepare
from slotserve.server.chat.structured import GrammarCache, configure, configured
from slotserve.server.http.state import ServerState

MIB = 2**20
KV = KVConfig(layout="cell", max_seqs=2, max_context=256)


def _plan(
    tiny: ss.Model, runtime: int, peak: int = 0, memory_budget: int | None = None
) -> CapacityPlan:
    held = MemoryLedger()
    held.add("runtime", runtime, "measured", "the test")
    held.add("weights", tiny.weight_bytes, "computed", "the test")
    if peak:
        held.add_peak("load", peak, "the test")
    return CapacityPlan(tiny.info, KV, held, memory_budget=memory_budget)


def test_the_budget_holds_the_larger_of_the_worst_case_and_the_load_peak(tiny: ss.Model) -> None:
    serving = _plan(tiny, 200 * MIB)
    peak = serving.worst_case_bytes + 30 * MIB
    plan = _plan(tiny, 200 * MIB, peak)
    assert plan.worst_case_bytes == serving.worst_case_bytes == sum(plan.arenas.values())
    assert plan.required_bytes == peak
    assert "load" not in plan.arenas  # not an arena: its copies are gone after the load
    between = dataclasses.replace(plan, memory_budget=serving.worst_case_bytes + 10 * MIB)
    assert serving.worst_case_bytes < between.memory_budget < peak  # type: ignore[operator]
    assert not between.fits and between.headroom == -20 * MIB
    with pytest.raises(LoadPeakError) as refused:
        between.check()
    assert refused.value.peak_bytes == peak and refused.value.budget_bytes == between.memory_budget
    message = str(refused.value)
    assert f"loading the model peaks at {format_bytes(peak)}" in message
    assert f"at least {format_bytes(peak)}" in message
    assert between.max_seqs_that_fit() == 0  # no concurrency loads it
    enough = dataclasses.replace(plan, memory_budget=peak)
    enough.check()
    report = enough.to_dict()
    assert (report["load_peak_bytes"], report["required_bytes"]) == (peak, peak)
    assert report["headroom_bytes"] == 0


def test_a_load_peak_under_the_worst_case_changes_nothing(tiny: ss.Model) -> None:
    serving = _plan(tiny, 200 * MIB, memory_budget=10**10)
    plan = _plan(tiny, 200 * MIB, serving.worst_case_bytes - 1, memory_budget=10**10)
    assert plan.required_bytes == plan.worst_case_bytes
    assert plan.headroom == serving.headroom and plan.fits


def test_the_runtime_refusal_comes_before_the_load_peaks(tiny: ss.Model) -> None:
    plan = _plan(tiny, 300 * MIB, 400 * MIB, memory_budget=100 * MIB)
    refusal = plan.runtime_refusal()
    assert refusal is not None and not isinstance(refusal, LoadPeakError)
    assert "the runtime alone" in str(refusal)


def test_the_process_plan_takes_the_load_peak_in_process_scope(tiny: ss.Model) -> None:
    model = ss.load(Path(tiny.source))
    assert model.ledger is not None
    (peak,) = model.ledger.peaks
    assert peak.name == "load" and peak.bytes >= model.ledger.bytes("runtime") > 0
    with ss.Engine(model, EngineConfig(budget_scope="process", max_context=64)) as engine:
        assert engine.plan.load_peak_bytes == peak.bytes
    with ss.Engine(model, EngineConfig(budget_scope="model", max_context=64)) as engine:
        assert engine.plan.load_peak_bytes == 0


LOAD_PROBE = """
import json
import slotserve as ss
from slotserve.memory import anonymous_bytes
model = ss.load("bundled", progress=False)
(peak,) = model.ledger.peaks
print(json.dumps({"peak": peak.bytes, "loaded": anonymous_bytes(), "weights": model.weight_bytes}))
"""


def test_the_bundled_models_load_does_not_keep_the_file_resident() -> None:
    """The load copies each tensor out of the file's map and drops the map's pages: its peak
    (anonymous, and the model file's pages it mapped) above what it ends with stays under
    0.5x the weights; with the whole file resident beside the weights read from it, it was
    above 1x. Measured in a fresh process, as a server loads: in the suite's process the
    peak depends on what it loaded and freed before."""
    probe = subprocess.run(
        [sys.executable, "-c", LOAD_PROBE], capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr
    measured = json.loads(probe.stdout.strip().splitlines()[-1])
    assert measured["peak"]
    transient = measured["peak"] - measured["loaded"]
    assert transient <= 0.5 * measured["weights"], (
        f"the load peaked {format_bytes(transient)} above its end, for weights of "
        f"{format_bytes(measured['weights'])}"
    )


def _rss_file_kib() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def test_release_mapped_drops_the_pages_and_keeps_the_data(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 255, 16 * MIB, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    before = _rss_file_kib()
    total = int(mapped.sum(dtype=np.int64))  # every page faulted in
    assert _rss_file_kib() - before >= 15 * 1024
    tail = mapped[1000:]  # from inside the first page: it is dropped too
    release_mapped_range(tail.ctypes.data, tail.nbytes)
    assert _rss_file_kib() - before <= 1024
    assert int(mapped.sum(dtype=np.int64)) == total == int(data.sum(dtype=np.int64))


CODE_PROBE = """
import json, torch
import slotserve as ss

def code_pages():
    # Resident bytes of each library's executable file mapping (/proc/self/smaps).
    pages, current = {}, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                current = None
                if len(fields) >= 6 and fields[1] == "r-xp" and fields[5].startswith("/"):
                    current = fields[0] + " " + fields[5]
            elif current is not None and fields[0] == "Rss:":
                pages[current] = int(fields[1]) * 1024
    return pages

torch.ones(4).sum()
before = code_pages()
model = ss.load("bundled", progress=False)
after = code_pages()
dropped = {name: (before[name], after.get(name, 0)) for name in before
           if after.get(name, 0) < before[name]}
print(json.dumps({"libraries": len(before), "dropped": dropped}))
"""


def test_a_load_leaves_every_librarys_code_pages_resident() -> None:
    """In a fresh process: loading a model drops no page of any library's code from the
    resident set (a load only loads: it never madvises another library's mappings, which
    freed no memory and only moved a reading)."""
    probe = subprocess.run(
        [sys.executable, "-c", CODE_PROBE], capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr
    measured = json.loads(probe.stdout.strip().splitlines()[-1])
    assert measured["libraries"] > 10  # python, torch's, numpy's, ...
    assert measured["dropped"] == {}


def _counted_index(compiler: GrammarCompiler) -> list[object]:
    """The tokenizer indexes ``compiler`` builds in this process, from now on."""
    built: list[object] = []
    build = compiler._tokenizer_index

    def counted() -> object:
        built.append(build())
        return built[-1]

    compiler._tokenizer_index = counted  # type: ignore[method-assign]
    return built


def test_prepare_measures_the_index_in_a_worker_and_the_server_cache_takes_that_compiler(
    tiny: ss.Model,
) -> None:
    config = GrammarConfig(max_bytes=4 * MIB, cache_bytes=4 * MIB)
    compiler = GrammarCompiler(tiny.tokenizer, tiny.info.vocab_size, config)
    built = _counted_index(compiler)
    try:
        cost = prepare(compiler)
        # Measured in a worker from before it imported llguidance: the library's own
        # shared object is part of it (over 2 MiB resident), and nothing is built here.
        assert cost.index_bytes >= MIB
        # A worker is a whole process: its interpreter and llguidance beside the index.
        assert cost.worker_bytes > cost.index_bytes and cost.workers == config.workers
        assert cost.workers_bytes == cost.workers * cost.worker_bytes
        assert built == [] and compiler._index is None and compiler._pool is None
        # Held here only once a structured request needs it.
        assert compiler.submit(None).result().matcher(tiny.info.vocab_size) is not None
        assert len(built) == 1 and compiler._index is not None and compiler._pool is not None
        assert GrammarCache(tiny, config=config, compiler=compiler).compiler is compiler
        other = GrammarConfig(max_bytes=4 * MIB, cache_bytes=8 * MIB)
        assert GrammarCache(tiny, config=other, compiler=compiler).compiler is not compiler
        before = configured()
        configure(config)  # as serve does before it builds the server state
        state = ServerState(None, "tiny", grammar_compiler=compiler)
        try:
            state.attach(ss.Engine(tiny, ss.EngineConfig(max_seqs=1, max_context=64)))
            assert state.grammars is not None and state.grammars.compiler is compiler
        finally:
            configure(before)
            if state.engine is not None:
                state.engine.close()
    finally:
        compiler.close()
    assert GrammarCache(tiny, config=config).compiler is not compiler


def test_prepare_without_a_worker_measures_the_index_here_then_releases_it(
    tiny: ss.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_worker(source: object) -> None:
        raise GrammarError("the grammar worker did not start: (test)")

    monkeypatch.setattr(grammar_index, "Worker", no_worker)
    compiler = GrammarCompiler(tiny.tokenizer, tiny.info.vocab_size)
    built = _counted_index(compiler)
    try:
        cost = prepare(compiler)
        assert cost.index_bytes >= 0 and cost.workers_bytes == 0  # no worker runs
        assert len(built) == 1  # built and measured here, not left to a request ...
        assert compiler._index is None and compiler._pool is None  # ... then released
    finally:
        compiler.close()
