"""The bundled model exported as an fp32 XNNPACK bundle gives the eager torch executor's greedy
tokens on public prompts, alone and batched (the export takes about three minutes of one
core, once per session, in a background process: tests/exports.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.artifact.bundle import read_bundle
from tests.exports import BUNDLED_FP32

NEW_TOKENS = 24
GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled_fp32(bundled_fp32_export: Path) -> ss.Model:
    """The bundle (`BUNDLED_FP32`), exported beside the suite's other tests."""
    bundle = bundled_fp32_export
    manifest = read_bundle(bundle).manifest
    assert (manifest.quant, manifest.max_tokens, manifest.max_context) == (
        BUNDLED_FP32["quant"],
        BUNDLED_FP32["max_tokens"],
        BUNDLED_FP32["max_context"],
    )
    return ss.load(bundle)


def generate(model: ss.Model, prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """Greedy tokens of each prompt, all submitted together, then each alone."""
    config = ss.EngineConfig(max_seqs=len(prompts), max_context=256, max_batch_tokens=128)
    with ss.Engine(model, config) as engine:
        together = [engine.submit(p, GREEDY) for p in prompts]
        batched = [h.result().tokens for h in together]
        alone = [engine.submit(p, GREEDY).result().tokens for p in prompts]
        engine.check_integrity()
    return batched, alone


@pytest.mark.slow
def test_fp32_bundle_generates_the_eager_models_tokens(
    bundled: ss.Model, bundled_fp32: ss.Model, reference: dict[str, Any]
) -> None:
    prompts = [case["prompt_tokens"] for case in reference["cases"]]
    assert bundled_fp32.weights is None and Path(bundled_fp32.source).is_dir()
    torch_batched, torch_alone = generate(bundled, prompts)
    ours_batched, ours_alone = generate(bundled_fp32, prompts)
    assert ours_alone == torch_alone
    assert ours_batched == torch_batched
