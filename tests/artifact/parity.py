"""Teacher-forced agreement with llama.cpp's references in tests/data, per KV dtype.

A reference (made by ``tools/llama_refs.py``; its meta names the model file) holds, for
each prompt, llama.cpp's greedy tokens and, at each position of them, its top-1 token and
its margin over the second. We score ``prompt + greedy[:-1]`` in one teacher-forced pass
over a pool of the given KV dtype, driven as `Model.logits` drives its own (the default
dtype is `Model.logits` itself), and count the positions whose argmax is llama.cpp's.

The targets (issue 27): agreement at least 95%, and every position where llama.cpp's
top-1 leads by a margin of 1.0 or more agrees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits as probe_logits

DATA = Path(__file__).parents[1] / "data"
MIN_AGREEMENT = 0.95
CONFIDENT_MARGIN = 1.0


def load_reference(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


def teacher_forced_logits(model: ss.Model, token_ids: list[int], kv_dtype: str) -> torch.Tensor:
    """``[T, vocab]`` logits of ``token_ids`` from an empty context, the pool's K/V stored
    as ``kv_dtype`` (`slotserve.engine.probe.teacher_forced_logits`)."""
    return probe_logits(model, token_ids, kv_dtype=kv_dtype)


@dataclass(frozen=True)
class Agreement:
    agree: int
    total: int
    confident_misses: tuple[str, ...]

    @property
    def rate(self) -> float:
        return self.agree / self.total

    def __str__(self) -> str:
        return (
            f"{self.agree}/{self.total} ({self.rate:.2%}), confident misses {self.confident_misses}"
        )


def agreement(model: ss.Model, reference: dict[str, Any], kv_dtype: str) -> Agreement:
    """The agreeing positions, the positions, and the confident positions that disagree;
    every prompt must tokenise as llama.cpp's did."""
    agree = total = 0
    misses = []
    for case in reference["cases"]:
        prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
        assert model.tokenizer.encode(case["prompt"]) == prompt, case["prompt"][:60]
        logits = teacher_forced_logits(model, prompt + greedy[:-1], kv_dtype)
        ours = logits[len(prompt) - 1 :].argmax(-1).tolist()
        pairs = zip(ours, case["teacher_forced_top1"], case["teacher_forced_margin"], strict=True)
        for position, (mine, theirs, margin) in enumerate(pairs):
            total += 1
            agree += mine == theirs
            if mine != theirs and margin >= CONFIDENT_MARGIN:
                misses.append(f"{case['prompt'][:30]!r} position {position}, margin {margin}")
    return Agreement(agree, total, tuple(misses))


def check(model: ss.Model, name: str, kv_dtype: str) -> None:
    """The targets on reference ``name`` with ``kv_dtype`` KV."""
    result = agreement(model, load_reference(name), kv_dtype)
    assert not result.confident_misses, f"{kv_dtype} KV: {result}"
    assert result.rate >= MIN_AGREEMENT, f"{kv_dtype} KV: {result}"
