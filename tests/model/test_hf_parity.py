"""Logits against transformers' reference implementation on the same tiny HF directories."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits
from slotserve.model import Model

transformers = pytest.importorskip("transformers")

KINDS = ("llama", "llama3-rope", "qwen2", "qwen3", "mistral", "mixed")


def _reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0]
    return logits


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tiny_dirs: dict[str, Path], kind: str) -> None:
    """With fp32 KV, which stores what transformers computes (the fp16 default rounds each
    K and V; its cost is measured against llama.cpp on real models, tests/artifact)."""
    ids = torch.randint(3, 259, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = teacher_forced_logits(ss.load(tiny_dirs[kind]), ids, kv_dtype="fp32")
    torch.testing.assert_close(ours, _reference_logits(tiny_dirs[kind], ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["mistral", "mixed"])
def test_sliding_window_is_in_effect(tiny_dirs: dict[str, Path], kind: str) -> None:
    # Guards the parity test above: with the window removed the logits past the window
    # differ, so both implementations really apply it.
    model = ss.load(tiny_dirs[kind])
    assert any(w is not None for w in model.info.sliding_window)
    full = Model.from_weights(
        dataclasses.replace(model.info, sliding_window=()), model.tokenizer, model.weights
    )
    ids = list(range(3, 33))
    windowed, whole = (
        teacher_forced_logits(model, ids, kv_dtype="fp32"),
        teacher_forced_logits(full, ids, kv_dtype="fp32"),
    )
    assert (windowed[10:] - whole[10:]).abs().max() > 1e-3
    torch.testing.assert_close(windowed[:4], whole[:4])


def test_mixed_layers_are_parsed(tiny_dirs: dict[str, Path]) -> None:
    info = ss.load(tiny_dirs["mixed"]).info
    assert info.sliding_window == (None, 5, None, 5)
    assert ss.load(tiny_dirs["qwen3"]).info.qk_norm
    assert ss.load(tiny_dirs["qwen2"]).info.qkv_bias
    assert ss.load(tiny_dirs["llama3-rope"]).info.rope.scaling == "llama3"
