"""The prefix store in the engine (``EngineConfig(prefix_store=...)``): a restarted engine,
or one whose process was killed (``kill -9``), restores a conversation from disk and gives
the tokens and log-probabilities of an engine that never cached, bit for bit, with the
restored tokens in ``cached_tokens``; on sliding-window models (a tiny Gemma 3 and Gemma 3
270M past its 512-token window) a conversation's next turn restores from disk and a stored
prefix a ring no longer holds is refused by the retention rule; the disk budget holds
under a storm of distinct prefixes; a store without the cache, or in a directory that
cannot be written, is refused at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.cli import main
from slotserve.engine.views import PrefixStoreStats
from slotserve.prefix import PrefixStoreError
from slotserve.testing import write_tiny_gguf
from tests.engine.test_exactness import trace

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=5)
# (The tiny conversations here are shorter than the store's default minimum to write.)
CELL: dict[str, Any] = {
    "kv_layout": "cell", "block_size": 8, "max_seqs": 2, "max_context": 256,
    "prefix_store_min_tokens": 1,
}  # fmt: skip
USER_TURNS = [[40 + i, 90 + 3 * i, 7, 11 + i] for i in range(5)]


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    """A tiny Llama on Q8_0 blocks: block halves on the kernels, where restores are exact."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("store") / "tiny-q8.gguf", "llama", "Q8_0")
    model = ss.load(path, progress=False)
    assert model.halves.kind == "block"
    return model


@pytest.fixture
def engines() -> Iterator[Callable[..., ss.Engine]]:
    made: list[ss.Engine] = []

    def make(model: ss.Model, **config: Any) -> ss.Engine:
        made.append(ss.Engine(model, ss.EngineConfig(**config)))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
        engine.check_integrity()


def converse(engine: ss.Engine, system: list[int], turns: list[list[int]]) -> list[int]:
    """A conversation of ``turns`` after ``system``, each turn kept in the cache (as the
    server and the runner keep them); the history the next turn continues."""
    history = list(system)
    for user in turns:
        handle = engine.submit([*history, *user], GREEDY, publish_completion=True)
        history = [*history, *user, *(t for t, _, _ in trace(handle))]
    return history


def store_stats(engine: ss.Engine) -> PrefixStoreStats:
    prefix = engine.stats().prefix
    assert prefix is not None and prefix.store is not None
    return prefix.store


def test_a_restart_restores_the_conversation_bit_for_bit(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    system = [5 + (i * 37) % 200 for i in range(61)]
    stored = {**CELL, "prefix_cache_bytes": "4MiB", "prefix_store": tmp_path}
    first = engines(exact, **stored)
    history = converse(first, system, USER_TURNS[:4])
    first.close()  # waits for the queued writes
    written = store_stats(first)
    assert written.queued == 0 and written.files >= 1 and written.written >= 1
    assert set(written.skipped) <= {"superseded"}  # each turn's snapshot replaced the last
    restarted = engines(exact, **stored)
    assert store_stats(restarted).files >= 1
    turn5 = [*history, *USER_TURNS[4]]
    handle = restarted.submit(turn5, GREEDY)
    got = trace(handle)
    final = handle.result()
    # The last turn's snapshot holds the history but its last sampled token, never fed.
    assert final.usage.cached_tokens == len(history) - 1
    timings = final.timings
    assert timings.prompt_tokens_restored == final.usage.cached_tokens
    # The read from disk happened at admission: inside the prefill span, which starts there.
    assert timings.restore_started is not None and timings.restore_time > 0
    assert timings.first_scheduled is not None
    assert timings.restore_started + timings.restore_time <= timings.first_scheduled
    assert store_stats(restarted).hits == 1
    cold = engines(exact, **CELL)
    assert got == trace(cold.submit(turn5, GREEDY))  # tokens, logprobs, top 5: bit for bit


KILLED = """
import json, sys
import slotserve as ss
sys.path.insert(0, {root!r})
from tests.engine.test_prefix_store_engine import CELL, USER_TURNS, converse
model = ss.load({model!r}, progress=False)
engine = ss.Engine(model, ss.EngineConfig(**CELL, prefix_cache_bytes="4MiB",
                                          prefix_store={store!r}))
history = converse(engine, {system!r}, USER_TURNS[:4])
engine.prefix.store.flush()  # the files are on disk; the engine is still serving
print(json.dumps(history), flush=True)
sys.stdin.read()  # until killed
"""


def test_kill_9_mid_conversation_then_the_next_turn_restores_from_disk(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    system = [9 + (i * 13) % 200 for i in range(70)]
    script = KILLED.format(
        root=str(Path(__file__).parents[2]), model=exact.source, store=str(tmp_path),
        system=system,
    )  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else "no output"
        history = json.loads(line)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    engine = engines(exact, **CELL, prefix_cache_bytes="4MiB", prefix_store=tmp_path)
    turn5 = [*history, *USER_TURNS[4]]
    handle = engine.submit(turn5, GREEDY)
    got = trace(handle)
    assert handle.result().usage.cached_tokens == len(history) - 1
    assert got == trace(engines(exact, **CELL).submit(turn5, GREEDY))


def test_a_sliding_window_model_refuses_a_prefix_its_rings_lost(
    engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    model = ss.load(write_tiny_gguf(tmp_path / "gemma3.gguf", "gemma3", "Q4_K_M"), progress=False)
    window = model.info.window(0)
    assert window is not None and model.halves.kind == "block"
    system = [5 + (i * 7) % 200 for i in range(4 * window)]
    stored = {**CELL, "prefix_cache_bytes": "4MiB", "prefix_store": tmp_path / "store"}
    first = engines(model, **stored)
    history = converse(first, system, USER_TURNS[:2])
    first.close()  # its queued writes done
    restarted = engines(model, **stored)
    # The conversation's next turn: its rings hold what it needs, restored from disk.
    turn3 = [*history, *USER_TURNS[2]]
    handle = restarted.submit(turn3, GREEDY)
    got = trace(handle)
    assert handle.result().usage.cached_tokens == len(history) - 1
    assert got == trace(engines(model, **CELL).submit(turn3, GREEDY))
    # The system prompt alone, with another question: token-equal, but the stored rings
    # were written far past it. Refused by rule, counted, computed.
    other = engines(model, **stored)
    handle = other.submit([*system, 1, 2], GREEDY)
    assert handle.result().usage.cached_tokens == 0
    assert store_stats(other).refused == {"retention": 1}


def test_the_disk_budget_holds_under_a_storm_of_distinct_prefixes(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    engine = engines(
        exact, **CELL, prefix_cache_bytes="4MiB", prefix_store=tmp_path,
        prefix_store_bytes=200_000,
    )  # fmt: skip
    assert engine.prefix is not None and engine.prefix.store is not None
    for i in range(24):
        prompt = [1 + (i * 31 + j * 7) % 250 for j in range(40)]
        params = ss.SamplingParams(temperature=0, max_new_tokens=2)
        engine.submit(prompt, params, publish_completion=True).result()  # each a turn, written
        assert store_stats(engine).bytes <= 200_000
        if i % 2:
            # Every other prompt waits for the writer, so enough files land that the budget
            # must evict: on a loaded machine the writer (nice 10) once fell so far behind
            # that it wrote 9 of 24 and skipped the rest, and the 9 fit.
            engine.prefix.store.flush()
    engine.prefix.store.flush()
    engine.prefix.store.check_integrity()
    stats = store_stats(engine)
    assert stats.bytes <= 200_000 and stats.evictions > 0
    assert stats.written + sum(stats.skipped.values()) >= 24
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.kvsnap"))
    assert on_disk == stats.bytes


def test_a_store_needs_the_cache_and_a_writable_directory(exact: ss.Model, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the cache on"):
        ss.EngineConfig(**CELL, prefix_store=tmp_path)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(PrefixStoreError, match="pass a writable directory"):
        ss.Engine(exact, ss.EngineConfig(**CELL, prefix_cache_bytes="1MiB", prefix_store=a_file))


def test_gemma3_restores_a_conversation_past_its_window_and_refuses_what_its_rings_lost(
    gemma3: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    """Gemma 3 270M: five local layers in six keep the last 512 positions."""
    encode = gemma3.tokenizer.encode
    system = encode("You keep the records of a small coastal town and answer plainly. " * 40)
    window = gemma3.info.window(0)
    assert window is not None and len(system) > window
    config = {"kv_layout": "cell", "block_size": 16, "max_seqs": 2, "max_context": 1024}
    stored = {**config, "prefix_cache_bytes": "64MiB", "prefix_store": tmp_path}
    params = ss.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=5)
    first = engines(gemma3, **stored)
    prompt = [*system, *encode(" When did the great storm come?", add_bos=False)]
    reply = [t for t, _, _ in trace(first.submit(prompt, params, publish_completion=True))]
    first.close()
    follow = [*prompt, *reply, *encode(" And after that?", add_bos=False)]
    restarted = engines(gemma3, **stored)
    handle = restarted.submit(follow, params)
    got = trace(handle)
    assert handle.result().usage.cached_tokens == len(prompt) + len(reply) - 1
    assert got == trace(engines(gemma3, **config).submit(follow, params))  # bit for bit
    # The system prompt with another question: token-equal, but every stored ring was
    # written past it. Refused by the rule, counted, computed.
    other = engines(gemma3, **stored)
    question = [*system, *encode(" Who built the lighthouse?", add_bos=False)]
    assert other.submit(question, params).result().usage.cached_tokens == 0
    assert store_stats(other).refused == {"retention": 1}


def test_the_plan_shows_what_the_store_holds_and_changes_nothing_on_disk(
    exact: ss.Model,
    engines: Callable[..., ss.Engine],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``slotserve plan --prefix-store`` reads the store's headers as ``serve`` would at
    start: its snapshots, their bytes, the refused files by reason and the index time. It
    deletes nothing: a damaged file and a torn write stay for the next start to remove."""
    store_dir = tmp_path / "store"
    stored = {**CELL, "prefix_cache_bytes": "4MiB", "prefix_store": store_dir}
    first = engines(exact, **stored)
    converse(first, [5 + (i * 37) % 200 for i in range(40)], USER_TURNS[:2])
    converse(first, [9 + (i * 11) % 200 for i in range(40)], USER_TURNS[2:3])
    first.close()
    files = sorted(store_dir.glob("*.kvsnap"))
    assert len(files) >= 2
    damaged = files[0]
    damaged.write_bytes(damaged.read_bytes()[:-1])  # truncated: a checksum refusal
    (store_dir / ".tmp-torn").write_bytes(b"SLOTKV")
    before = {p.name: p.read_bytes() for p in store_dir.iterdir()}
    argv = ["plan", "--model", exact.source, "--json", "--kv-layout", "cell", "--block-size"]
    argv += ["8", "--max-seqs", "2", "--max-context", "256", "--prefix-cache", "4MiB"]
    assert main([*argv, "--prefix-store", str(store_dir)]) == 0
    report = json.loads(capsys.readouterr().out)["prefix_store"]
    assert {p.name: p.read_bytes() for p in store_dir.iterdir()} == before
    intact = files[1:]
    assert report["files"] == len(intact) and report["refused"] == {"checksum": 1}
    assert report["bytes"] == sum(p.stat().st_size for p in intact)
    assert 0 < report["index_seconds"] < 10 and report["directory"] == str(store_dir)
    started = store_stats(engines(exact, **stored))  # the start indexes the same files
    assert (started.files, started.bytes) == (report["files"], report["bytes"])
    assert not damaged.exists() and not (store_dir / ".tmp-torn").exists()
