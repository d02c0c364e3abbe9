"""The command line on the bundled model and on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert out["stats"]["num_generated_tokens"] == 8


def test_generate_streams_a_chat_answer(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        "What is the capital of France?",
        "--chat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
    ]
    assert main(argv) == 0
    assert "Paris" in capsys.readouterr().out


def test_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "bundled"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layers"] == 30 and out["weight_bytes"] > 100e6 and out["parameters"] > 130e6


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
