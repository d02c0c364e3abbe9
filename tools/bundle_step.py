"""A bundle's forward step against the eager model's, its teacher-forced agreement with
llama.cpp's reference, and the resident memory it costs (figures in docs/EXECUTORCH-NOTES.md).

    slotserve export bundled OUT/           # once (minutes on 2 cores)
    python tools/bundle_step.py OUT/        # measures the bundle OUT/ (exported from bundled)
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import slotserve as ss
from slotserve.executor import executor_for
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.memory import rss_bytes

REFERENCE = Path(__file__).parents[1] / "tests" / "data" / "llamacpp_greedy.json"
Step = Callable[[torch.Tensor, StepBatch, KVPool], torch.Tensor]


def agreement(model: ss.Model, step: Step) -> tuple[int, int, int]:
    """(agreeing positions, positions, misses where llama.cpp's margin >= 1)."""
    agree = total = misses = 0
    for case in json.loads(REFERENCE.read_text())["cases"]:
        prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
        pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=256))
        pool.reserve(0, 256)
        batch = StepBatch.single(0, len(prompt))
        pool.begin_step(batch)
        rows = [step(torch.tensor(prompt), batch, pool)[0]]
        for position, token in enumerate(greedy[:-1], start=len(prompt)):
            batch = StepBatch.single(position, 1)
            pool.begin_step(batch)
            rows.append(step(torch.tensor([token]), batch, pool)[0])
        ours = torch.stack(rows).argmax(-1).tolist()
        for mine, theirs, margin in zip(
            ours, case["teacher_forced_top1"], case["teacher_forced_margin"], strict=True
        ):
            total += 1
            agree += mine == theirs
            misses += margin >= 1.0 and mine != theirs
    return agree, total, misses


def decode_ms(model: ss.Model, step: Step, sequences: int, context: int = 300) -> float:
    """Median time of 20 decode steps of ``sequences`` sequences after ``context`` tokens."""
    pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=sequences, max_context=512))
    for session in range(sequences):
        pool.reserve(session, context + 32)
    for session in range(sequences):  # one prompt a step: within the program's 512 tokens
        batch = StepBatch.single(0, context, session)
        pool.begin_step(batch)
        step(torch.randint(100, 1000, (context,)), batch, pool)
    times = []
    for _ in range(20):
        starts = [pool.length(s) for s in range(sequences)]
        batch = StepBatch(list(range(sequences)), starts, [1] * sequences)
        began = time.perf_counter()
        pool.begin_step(batch)
        step(torch.randint(100, 1000, (sequences,)), batch, pool)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    before = rss_bytes()
    bundle = Path(sys.argv[1])
    executor = executor_for(ss.load(bundle, progress=False))
    resident = rss_bytes() - before
    files = executor.weight_bytes / 2**20
    print(f"bundle {bundle}: files {files:.1f} MiB, RSS growth on load {resident / 2**20:.1f} MiB")
    model = ss.load("bundled", progress=False)
    agree, total, misses = agreement(model, executor.step)
    print(f"agreement with llama.cpp: {agree}/{total} ({agree / total:.1%}), {misses} misses")
    for sequences in (1, 4, 8):
        fast = decode_ms(model, executor.step, sequences)
        eager = decode_ms(model, model.forward, sequences)
        print(f"{sequences} sequences: bundle {fast:.1f} ms, eager {eager:.1f} ms")


if __name__ == "__main__":
    main()
