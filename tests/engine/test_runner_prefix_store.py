"""The prefix store through `TextLLMRunner` (``prefix_store=...``): a runner closed after a
conversation (its writes done), or whose process was killed (``kill -9``) once its writes
were on disk, and started again on the same directory resumes the conversation from disk,
restoring all of it but the last sampled token, and answers with the tokens of a runner that
never cached, token for token; on a sliding-window model its next turn restores past the
window; a store without the cache is refused with the fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.runner import GenerationConfig
from slotserve.testing import write_tiny_gguf

GREEDY = GenerationConfig(echo=False, temperature=0, max_new_tokens=10, ignore_eos=True)
SYSTEM = [5 + (i * 37) % 200 for i in range(61)]
TURNS = [[40 + i, 90 + 3 * i, 7, 11 + i] for i in range(5)]
CONTEXT = 256


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    """A tiny Llama on Q8_0 blocks: block halves on the kernels, where restores are exact."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("runner") / "tiny-q8.gguf", "llama", "Q8_0")
    model = ss.load(path, progress=False)
    assert model.halves.kind == "block"
    return model


def talk(runner: ss.TextLLMRunner, turns: list[list[int]]) -> list[ss.GenerationResult]:
    results = [runner.generate([*SYSTEM, *turns[0]], GREEDY)]
    results += [runner.generate(turn, GREEDY) for turn in turns[1:]]
    return results


def store_of(runner: ss.TextLLMRunner) -> ss.EngineStats:
    engine = runner._engine
    assert engine is not None
    return engine.stats()


def test_a_restarted_runner_resumes_the_conversation_from_disk(
    exact: ss.Model, tmp_path: Path
) -> None:
    first = ss.TextLLMRunner(exact, max_context=CONTEXT, prefix_store=tmp_path)
    talk(first, TURNS[:4])
    conversation = first.conversation
    assert len(conversation) == first.position + 1  # the last sampled token, still to feed
    first.close()  # waits for the queued writes
    assert list(tmp_path.glob("*.kvsnap"))

    restarted = ss.TextLLMRunner(exact, max_context=CONTEXT, prefix_store=tmp_path)
    resumed = restarted.generate([*conversation, *TURNS[4]], GREEDY)
    stats = resumed.stats
    # Everything the last turn's snapshot holds: the conversation less the token never fed.
    assert stats.prompt_tokens_restored == len(conversation) - 1
    assert stats.prompt_tokens_computed == 1 + len(TURNS[4])
    prefix = store_of(restarted).prefix
    assert prefix is not None and prefix.store is not None and prefix.store.hits == 1
    restarted.close()

    cold = ss.TextLLMRunner(exact, max_context=CONTEXT, prefix_cache=False)
    plain = cold.generate([*conversation, *TURNS[4]], GREEDY)
    assert plain.stats.prompt_tokens_restored == 0
    never_restarted = ss.TextLLMRunner(exact, max_context=CONTEXT)  # its cache in memory
    turn5 = talk(never_restarted, TURNS)[-1]
    assert turn5.stats.prompt_tokens_restored == len(conversation) - 1
    assert resumed.tokens == plain.tokens == turn5.tokens
    assert resumed.text == plain.text


KILLED = """
import json, sys
import slotserve as ss
sys.path.insert(0, {root!r})
from tests.engine.test_runner_prefix_store import CONTEXT, TURNS, talk
model = ss.load({model!r}, progress=False)
runner = ss.TextLLMRunner(model, max_context=CONTEXT, prefix_store={store!r})
talk(runner, TURNS[:4])
runner._engine.prefix.store.flush()  # the files are on disk; the runner still holds them
print(json.dumps(runner.conversation), flush=True)
sys.stdin.read()  # until killed
"""


def test_a_killed_runner_s_conversation_resumes_from_disk(exact: ss.Model, tmp_path: Path) -> None:
    script = KILLED.format(
        root=str(Path(__file__).parents[2]), model=exact.source, store=str(tmp_path)
    )
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else "no output"
        conversation = json.loads(line)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    restarted = ss.TextLLMRunner(exact, max_context=CONTEXT, prefix_store=tmp_path)
    try:
        resumed = restarted.generate([*conversation, *TURNS[4]], GREEDY)
    finally:
        restarted.close()
    assert resumed.stats.prompt_tokens_restored == len(conversation) - 1
    cold = ss.TextLLMRunner(exact, max_context=CONTEXT, prefix_cache=False)
    assert resumed.tokens == cold.generate([*conversation, *TURNS[4]], GREEDY).tokens


def test_a_sliding_window_runner_resumes_past_its_window(tmp_path: Path) -> None:
    model = ss.load(write_tiny_gguf(tmp_path / "gemma3.gguf", "gemma3", "Q4_K_M"), progress=False)
    window = model.info.window(0)
    assert window is not None and len(SYSTEM) > 4 * window
    store = tmp_path / "store"
    first = ss.TextLLMRunner(model, max_context=CONTEXT, prefix_store=store)
    talk(first, TURNS[:2])
    conversation = first.conversation
    first.close()
    restarted = ss.TextLLMRunner(model, max_context=CONTEXT, prefix_store=store)
    try:
        resumed = restarted.generate([*conversation, *TURNS[2]], GREEDY)
    finally:
        restarted.close()
    assert resumed.stats.prompt_tokens_restored == len(conversation) - 1 > window
    cold = ss.TextLLMRunner(model, max_context=CONTEXT, prefix_cache=False)
    assert resumed.tokens == cold.generate([*conversation, *TURNS[2]], GREEDY).tokens


def test_a_runner_store_needs_the_cache(exact: ss.Model, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs prefix_cache=True"):
        ss.TextLLMRunner(exact, prefix_cache=False, prefix_store=tmp_path)
    assert not list(tmp_path.iterdir())  # refused before anything was opened
