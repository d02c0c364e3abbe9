"""Scenario ``single``: one stream, prefill tok/s and decode tok/s at several prompt lengths."""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.progress import Progress

from slotserve.bench.stats import summary
from slotserve.executor import Executor, TorchExecutor, executor_for
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model import Model
from slotserve.model.layers import DenseLinear
from slotserve.model.quantized import quantize_int8

PROMPT_LENGTHS = (32, 256, 1024)
DECODE_TOKENS = 32


def _one_run(executor: Executor, kv: KVPool, prompt: torch.Tensor) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation from an empty slot."""
    kv.rewind(0, kv.length(0))
    start = time.perf_counter()
    batch = StepBatch.single(0, len(prompt))
    kv.begin_step(batch)
    logits = executor.step(prompt, batch, kv)
    prefill_s = time.perf_counter() - start
    position = len(prompt)
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = logits[0].argmax().view(1)
        batch = StepBatch.single(position, 1)
        kv.begin_step(batch)
        logits = executor.step(token, batch, kv)
        position += 1
    decode_s = time.perf_counter() - start
    return len(prompt) / prefill_s, DECODE_TOKENS / decode_s


def _measure(
    executor: Executor, kv: KVPool, prompt: torch.Tensor, repeats: int, advance: Any
) -> list[tuple[float, float]]:
    _one_run(executor, kv, prompt)  # warm-up, not counted
    advance()
    runs = []
    for _ in range(repeats):
        runs.append(_one_run(executor, kv, prompt))
        advance()
    return runs


def run_single(model: Model, repeats: int = 5) -> dict[str, Any]:
    """The model as loaded (GGUF blocks by default) and, for dense weights, the same model
    with int8 projections, the same prompts, in the same run; block weights and a bundle
    alone (their weights are fixed: a file's blocks, an export), a bundle with prompts no
    longer than its largest step. In process, as a library user runs it."""
    executor = executor_for(model)
    longest = min(model.info.max_context - DECODE_TOKENS, executor.max_step_tokens or 1 << 30)
    lengths = [n for n in PROMPT_LENGTHS if n <= longest]
    context = max(lengths) + DECODE_TOKENS
    config = KVConfig(layout="flat", max_seqs=1, max_context=context)
    kv = KVPool(model.info, config, model.kernels.attention)
    kv.reserve(0, context)
    int8 = None
    if model.weights is not None and isinstance(model.weights.layers[0].qkv, DenseLinear):
        int8 = TorchExecutor(
            Model.from_weights(
                model.info, model.tokenizer, quantize_int8(model.weights), model.source
            )
        )
    gen = torch.Generator().manual_seed(0)
    rows = []
    with Progress(transient=True) as progress:
        runs_per_length = 2 if int8 is not None else 1
        task = progress.add_task(
            "bench single", total=runs_per_length * len(lengths) * (repeats + 1)
        )

        def advance() -> None:
            progress.advance(task)

        for length in lengths:
            prompt = torch.randint(100, model.info.vocab_size, (length,), generator=gen)
            runs = _measure(executor, kv, prompt, repeats, advance)
            row = {
                "prompt_tokens": length,
                "prefill_tok_s": summary([r[0] for r in runs]),
                "decode_tok_s": summary([r[1] for r in runs]),
            }
            if int8 is not None:
                quantised = _measure(int8, kv, prompt, repeats, advance)
                row["decode_tok_s_int8"] = summary([r[1] for r in quantised])
            rows.append(row)
    return {
        "decode_tokens": DECODE_TOKENS,
        "repeats": repeats,
        "rows": rows,
        "halves": model.halves.kind,
        "torch_threads": torch.get_num_threads(),
    }
