"""The runner and `slotserve chat` cache a conversation's prefix only where restoring it is
exact (issue 52, item 2): `slotserve serve`'s rule (`engine.prefix_share.is_exact`), the
same at every entry point, each logging why the cache is on or off.

Exact: a GGUF's blocks on the compiled kernels. Not exact: the same file's weights
dequantised (``weights="fp32"``), a Hugging Face directory (dense) and a bundle's program.
On an exact model a second turn restores the first; elsewhere it computes it again, unless
the caller turns the cache on anyway (``prefix_cache=True``, ``chat --prefix-cache``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.cli import main
from slotserve.runner import GenerationConfig, TextLLMRunner
from slotserve.testing import write_tiny_gguf

GREEDY = GenerationConfig(echo=False, temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("rule") / "tiny-q8.gguf", "llama", "Q8_0")


@pytest.fixture(scope="module")
def exact(gguf: Path) -> ss.Model:
    model = ss.load(gguf, progress=False)
    assert model.halves.kind == "block"
    return model


@pytest.fixture(scope="module")
def dequantised(gguf: Path) -> ss.Model:
    model = ss.load(gguf, weights="fp32", progress=False)
    assert model.halves.kind != "block"
    return model


def two_turns(runner: TextLLMRunner) -> list[ss.GenerationResult]:
    first = runner.generate(list(range(5, 25)), GREEDY)
    return [first, runner.generate([30, 31], GREEDY)]


def prefix_cache_logs(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and r.getMessage().startswith("prefix cache")
    ]


def test_the_runner_caches_on_an_exact_model(
    exact: ss.Model, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.runner")
    runner = TextLLMRunner(exact, max_context=128)
    first, second = two_turns(runner)
    choice = runner.prefix_cache_choice
    assert choice is not None and choice.on and choice.exact
    assert second.stats.prompt_tokens_restored == 20 + len(first.tokens) - 1
    assert prefix_cache_logs(caplog, "slotserve.runner") == [
        "prefix cache on: restoring the conversation is bit-exact here (prefix_cache=False: off)"
    ]
    runner.close()


@pytest.mark.parametrize("kind", ["dequantised", "hf"])
def test_the_runner_computes_every_turn_where_restoring_is_not_exact(
    kind: str,
    dequantised: ss.Model,
    tiny: ss.Model,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.runner")
    model = dequantised if kind == "dequantised" else tiny
    runner = TextLLMRunner(model, max_context=128)
    first, second = two_turns(runner)
    choice = runner.prefix_cache_choice
    assert choice is not None and not choice.on and not choice.exact
    engine = runner._engine
    assert engine is not None and engine.prefix is None
    assert second.stats.prompt_tokens_restored == 0
    assert second.stats.prompt_tokens_computed == 20 + len(first.tokens) - 1 + 1 + 2
    (line,) = prefix_cache_logs(caplog, "slotserve.runner")
    assert line.startswith(f"prefix cache off: {model.source} runs {model.halves.kind} halves")
    assert "not bit-exact" in line and "prefix_cache=True turns it on anyway" in line
    runner.close()


def test_asking_keeps_the_cache_on_anyway_and_says_so(
    tiny: ss.Model, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.runner")
    runner = TextLLMRunner(tiny, max_context=128, prefix_cache=True)
    first, second = two_turns(runner)
    assert second.stats.prompt_tokens_restored == 20 + len(first.tokens) - 1
    (line,) = prefix_cache_logs(caplog, "slotserve.runner")
    assert line.startswith("prefix cache on (prefix_cache=True), though ")
    runner.close()


def test_a_store_on_a_model_where_the_cache_is_off_is_refused_with_the_fix(
    tiny: ss.Model, tmp_path: Path
) -> None:
    runner = TextLLMRunner(tiny, max_context=128, prefix_store=tmp_path)
    with pytest.raises(ValueError, match=r"the cache is off: .* pass prefix_cache=True"):
        runner.load()
    assert not runner.is_loaded() and not list(tmp_path.iterdir())


@pytest.mark.exports("tiny_bundle")
def test_the_runner_does_not_cache_on_a_bundle(request: pytest.FixtureRequest) -> None:
    bundle = ss.load(request.getfixturevalue("tiny_bundle"))
    runner = TextLLMRunner(bundle, max_context=128)
    first, second = two_turns(runner)
    choice = runner.prefix_cache_choice
    assert choice is not None and not choice.on and "program halves" in choice.inexact
    assert second.stats.prompt_tokens_restored == 0
    assert second.stats.prompt_tokens_computed == 20 + len(first.tokens) - 1 + 1 + 2
    runner.close()


# -- slotserve chat ----------------------------------------------------------------------


@pytest.fixture
def chat_turns(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ss.GenerationResult]]:
    """Two typed messages, then an empty line; each turn's result, as chat's runner gave
    it. The runner's log level, which chat lowers, is put back afterwards."""
    results: list[ss.GenerationResult] = []
    original = TextLLMRunner.generate_from_pos

    def recording(self: TextLLMRunner, *args: Any, **kwargs: Any) -> ss.GenerationResult:
        result = original(self, *args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(TextLLMRunner, "generate_from_pos", recording)
    lines = iter(["hello there", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
    runner_log = logging.getLogger("slotserve.runner")
    level = runner_log.level
    yield results
    runner_log.setLevel(level)


CHAT = ["chat", "--max-new-tokens", "4", "--temperature", "0", "--max-context", "256"]


def test_chat_caches_on_an_exact_model(
    gguf: Path, chat_turns: list[ss.GenerationResult], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.chat")
    assert main([*CHAT, "--model", str(gguf)]) == 0
    first, second = chat_turns
    assert second.stats.prompt_tokens_restored >= first.stats.num_prompt_tokens > 0
    assert prefix_cache_logs(caplog, "slotserve.chat") == [
        "prefix cache on: restoring the conversation is bit-exact here (--no-prefix-cache: off)"
    ]


@pytest.mark.parametrize("where", ["weights fp32", "hf"])
def test_chat_computes_every_turn_where_restoring_is_not_exact(
    where: str,
    gguf: Path,
    tiny_dirs: dict[str, Path],
    chat_turns: list[ss.GenerationResult],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.chat")
    model = ["--model", str(gguf), "--weights", "fp32"] if where == "weights fp32" else []
    model = model or ["--model", str(tiny_dirs["llama"])]
    assert main([*CHAT, *model]) == 0
    first, second = chat_turns
    assert second.stats.prompt_tokens_restored == 0
    assert second.stats.prompt_tokens_computed > first.stats.num_prompt_tokens
    (line,) = prefix_cache_logs(caplog, "slotserve.chat")
    assert line.startswith("prefix cache off: ") and "not bit-exact" in line
    assert line.endswith("(--prefix-cache turns it on anyway)")


def test_chat_prefix_cache_keeps_it_on_anyway(
    tiny_dirs: dict[str, Path],
    chat_turns: list[ss.GenerationResult],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.chat")
    assert main([*CHAT, "--model", str(tiny_dirs["llama"]), "--prefix-cache"]) == 0
    first, second = chat_turns
    assert second.stats.prompt_tokens_restored >= first.stats.num_prompt_tokens > 0
    (line,) = prefix_cache_logs(caplog, "slotserve.chat")
    assert line.startswith("prefix cache on (--prefix-cache), though ")


def test_chat_no_prefix_cache_turns_it_off_on_an_exact_model(
    gguf: Path, chat_turns: list[ss.GenerationResult], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slotserve.chat")
    assert main([*CHAT, "--model", str(gguf), "--no-prefix-cache"]) == 0
    assert chat_turns[1].stats.prompt_tokens_restored == 0
    assert prefix_cache_logs(caplog, "slotserve.chat") == ["prefix cache off (--no-prefix-cache)"]
