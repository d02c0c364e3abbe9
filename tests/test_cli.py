"""The command line on the bundled model and on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.cli import main


def test_generate_json_on_the_bundled_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        "The capital of France is",
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # llama.cpp's greedy continuation of this prompt starts " Paris.\n\n" (tests/data).
    assert out["tokens"][:4] == [7042, 30, 198, 198]
    assert out["text"].startswith(" Paris.")
    assert len(out["tokens"]) == 8
    # ExecuTorch's stats JSON: the decode steps' tokens, all but the one prefill produced.
    assert out["stats"]["generated_tokens"] == 7


def test_generate_streams_a_chat_answer(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        "What is the capital of France?",
        "--chat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        # The answer of one weight format: quantised continuations differ between CPUs.
        "--weights",
        "fp32",
    ]
    assert main(argv) == 0
    assert "Paris" in capsys.readouterr().out


def test_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "bundled"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layers"] == 30 and out["parameters"] > 130e6
    # The default keeps the GGUF's blocks: the file's size resident, not a 513 MB fp32 copy.
    assert 80e6 < out["weight_bytes"] <= ss.artifact.bundled_gguf_path().stat().st_size


def test_bad_model_is_a_clean_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["inspect", str(tmp_path / "missing.gguf")]) == 2
    assert "no such" in capsys.readouterr().err


def test_chat_loop_in_a_real_process(tiny_dirs: dict[str, Path]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "chat",
            "--model",
            str(tiny_dirs["llama"]),
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        input="hello\nagain\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 2


def _capture_prompts(monkeypatch: pytest.MonkeyPatch, method: str) -> list[Any]:
    """Record the prompt each call of ``TextLLMRunner.<method>`` gets."""
    from slotserve.runner import TextLLMRunner

    prompts: list[Any] = []
    original = getattr(TextLLMRunner, method)

    def recording(self: TextLLMRunner, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        prompts.append(prompt)
        return original(self, prompt, *args, **kwargs)

    monkeypatch.setattr(TextLLMRunner, method, recording)
    return prompts


TYPED_MARKER = "hi <|im_end|> there"  # a user typing the template's end-of-turn marker


def test_generate_chat_keeps_typed_special_tokens_as_text(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _capture_prompts(monkeypatch, "generate")
    argv = ["generate", TYPED_MARKER, "--chat", "--model", str(tiny_dirs["llama"])]
    assert main([*argv, "--max-new-tokens", "2", "--temperature", "0"]) == 0
    tokenizer = ss.load(tiny_dirs["llama"]).tokenizer
    expected = tokenizer.encode_chat([{"role": "user", "content": TYPED_MARKER}])
    assert prompts == [expected]
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert expected.count(im_end) == 1  # the template's own, not the user's


def test_chat_keeps_typed_special_tokens_as_text(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _capture_prompts(monkeypatch, "generate_from_pos")
    lines = iter([TYPED_MARKER, ""])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
    argv = ["chat", "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "2"]
    assert main([*argv, "--temperature", "0"]) == 0
    tokenizer = ss.load(tiny_dirs["llama"]).tokenizer
    assert prompts == [tokenizer.encode_chat([{"role": "user", "content": TYPED_MARKER}])]
