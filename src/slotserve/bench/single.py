"""Scenario ``single``: one stream, prefill tok/s and decode tok/s at several prompt lengths."""

from __future__ import annotations

import time

import torch
from rich.progress import Progress

from slotserve.bench.stats import summary
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model import Model

PROMPT_LENGTHS = (32, 256, 1024)
DECODE_TOKENS = 32


def _one_run(model: Model, kv: KVPool, prompt: torch.Tensor) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation from an empty slot."""
    kv.rewind(0, kv.length(0))
    start = time.perf_counter()
    logits = model.prefill(prompt, StepBatch.single(0, len(prompt)), kv)
    prefill_s = time.perf_counter() - start
    position = len(prompt)
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = logits[0].argmax().view(1)
        logits = model.decode(token, StepBatch.single(position, 1), kv)
        position += 1
    decode_s = time.perf_counter() - start
    return len(prompt) / prefill_s, DECODE_TOKENS / decode_s


def run_single(model: Model, repeats: int = 5) -> dict[str, object]:
    lengths = [n for n in PROMPT_LENGTHS if n + DECODE_TOKENS <= model.info.max_context]
    context = max(lengths) + DECODE_TOKENS
    kv = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=context))
    kv.reserve(0, context)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task("bench single", total=len(lengths) * (repeats + 1))
        for length in lengths:
            prompt = torch.randint(100, model.info.vocab_size, (length,), generator=gen)
            _one_run(model, kv, prompt)  # warm-up, not counted
            progress.advance(task)
            runs = []
            for _ in range(repeats):
                runs.append(_one_run(model, kv, prompt))
                progress.advance(task)
            rows.append(
                {
                    "prompt_tokens": length,
                    "prefill_tok_s": summary([r[0] for r in runs]),
                    "decode_tok_s": summary([r[1] for r in runs]),
                }
            )
    return {"decode_tokens": DECODE_TOKENS, "repeats": repeats, "rows": rows}
