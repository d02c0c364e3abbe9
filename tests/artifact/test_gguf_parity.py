"""Each model family and weight format against llama.cpp's own outputs (references made by
``tools/llama_refs.py``; their meta names the file): tokenisation equal on every prompt,
teacher-forced agreement at least 95%, and every position where llama.cpp's top-1 leads
by a logit margin of 1.0 or more agrees. The block weights run as loaded (the file's own
types, fused C halves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.bench.llama_server import smollm2_q4_k_m_path

DATA = Path(__file__).parents[1] / "data"


def agreement(model: ss.Model, reference: dict[str, Any]) -> tuple[int, int, list[str]]:
    """(agreeing positions, positions, the confident positions that disagree)."""
    agree = total = 0
    misses = []
    for case in reference["cases"]:
        prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
        assert model.tokenizer.encode(case["prompt"]) == prompt, case["prompt"][:60]
        ours = model.logits(prompt + greedy[:-1])[len(prompt) - 1 :].argmax(-1).tolist()
        pairs = zip(ours, case["teacher_forced_top1"], case["teacher_forced_margin"], strict=True)
        for position, (mine, theirs, margin) in enumerate(pairs):
            total += 1
            agree += mine == theirs
            if mine != theirs and margin >= 1.0:
                misses.append(f"{case['prompt'][:30]!r} position {position}, margin {margin}")
    return agree, total, misses


def check(model: ss.Model, name: str) -> None:
    reference = json.loads((DATA / name).read_text())
    agree, total, misses = agreement(model, reference)
    assert not misses, misses
    assert agree / total >= 0.95, f"agreement {agree}/{total}"


def test_gemma3_matches_llama_cpp(gemma3: ss.Model) -> None:
    """Two prompts run past the 512-token window of the five local layers in six."""
    assert gemma3.halves.kind == "block"
    check(gemma3, "llamacpp_gemma3.json")


def test_smollm2_q4_k_m_matches_llama_cpp() -> None:
    path = smollm2_q4_k_m_path()  # what `make bench-deps` writes
    if not path.is_file():
        pytest.skip(f"{path} is made by `make bench-deps` (llama-quantize)")
    model = ss.load(path, progress=False)
    assert model.halves.kind == "block"
    check(model, "llamacpp_smollm2_q4_k_m.json")
