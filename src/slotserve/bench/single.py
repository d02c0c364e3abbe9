"""Scenario ``single``: one stream, prefill tok/s and decode tok/s at several prompt lengths."""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.progress import Progress

from slotserve.bench.stats import summary
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model import Model
from slotserve.model.quantized import quantize_int8

PROMPT_LENGTHS = (32, 256, 1024)
DECODE_TOKENS = 32


def _one_run(model: Model, kv: KVPool, prompt: torch.Tensor) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation from an empty slot."""
    kv.rewind(0, kv.length(0))
    start = time.perf_counter()
    batch = StepBatch.single(0, len(prompt))
    kv.begin_step(batch)
    logits = model.prefill(prompt, batch, kv)
    prefill_s = time.perf_counter() - start
    position = len(prompt)
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = logits[0].argmax().view(1)
        batch = StepBatch.single(position, 1)
        kv.begin_step(batch)
        logits = model.decode(token, batch, kv)
        position += 1
    decode_s = time.perf_counter() - start
    return len(prompt) / prefill_s, DECODE_TOKENS / decode_s


def _measure(
    model: Model, kv: KVPool, prompt: torch.Tensor, repeats: int, advance: Any
) -> list[tuple[float, float]]:
    _one_run(model, kv, prompt)  # warm-up, not counted
    advance()
    runs = []
    for _ in range(repeats):
        runs.append(_one_run(model, kv, prompt))
        advance()
    return runs


def run_single(model: Model, repeats: int = 5) -> dict[str, Any]:
    """fp32 (as given) and int8 weights, the same prompts, in the same run."""
    lengths = [n for n in PROMPT_LENGTHS if n + DECODE_TOKENS <= model.info.max_context]
    context = max(lengths) + DECODE_TOKENS
    kv = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=context))
    kv.reserve(0, context)
    int8 = Model(model.info, model.tokenizer, quantize_int8(model.require_weights()), model.source)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task("bench single", total=2 * len(lengths) * (repeats + 1))

        def advance() -> None:
            progress.advance(task)

        for length in lengths:
            prompt = torch.randint(100, model.info.vocab_size, (length,), generator=gen)
            runs = _measure(model, kv, prompt, repeats, advance)
            quantised = _measure(int8, kv, prompt, repeats, advance)
            rows.append(
                {
                    "prompt_tokens": length,
                    "prefill_tok_s": summary([r[0] for r in runs]),
                    "decode_tok_s": summary([r[1] for r in runs]),
                    "decode_tok_s_int8": summary([r[1] for r in quantised]),
                }
            )
    return {"decode_tokens": DECODE_TOKENS, "repeats": repeats, "rows": rows}
