"""int8 weight linears: close to the dense projection, smaller, and the bundled model still
agrees with llama.cpp on most positions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slotserve as ss
from slotserve.model.layers import DenseLinear
from slotserve.model.quantized import Int8Linear, quantize_int8, with_weights


def test_int8_linear_is_close_to_dense() -> None:
    gen = torch.Generator().manual_seed(0)
    dense = DenseLinear(torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen))
    quantised = Int8Linear.from_dense(dense)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 64, generator=gen)
        expected = dense(x)
        error = (quantised(x) - expected).abs().max() / expected.abs().max()
        assert error < 0.03
    assert quantised.nbytes < 0.35 * dense.nbytes


def test_unknown_weight_format(tiny: ss.Model) -> None:
    with pytest.raises(ValueError, match="weights='int4'"):
        with_weights(tiny.weights, "int4")


def test_bundled_int8_agreement(bundled: ss.Model, reference: dict[str, Any]) -> None:
    int8 = ss.Model(bundled.info, bundled.tokenizer, quantize_int8(bundled.weights))
    assert int8.weight_bytes < 0.65 * bundled.weight_bytes
    agree = total = 0
    for case in reference["cases"]:
        prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
        top = int8.logits(prompt + greedy[:-1])[len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(top, case["teacher_forced_top1"], strict=True))
        total += len(top)
    # Measured 269/308 (87%); fp32 gets 296/308. int8 is the opt-in speed/accuracy trade.
    assert agree / total >= 0.82, f"{agree}/{total}"


def test_int8_model_serves(bundled: ss.Model) -> None:
    int8 = ss.Model(bundled.info, bundled.tokenizer, quantize_int8(bundled.weights))
    with ss.Engine(int8, ss.EngineConfig(max_seqs=2, max_context=256)) as engine:
        prompt = bundled.tokenizer.render_chat(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        final = engine.submit(prompt, ss.SamplingParams(temperature=0, max_new_tokens=12)).result()
    assert "Paris" in final.text
