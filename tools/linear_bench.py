"""Time the block kernel's `linear` alone on random valid blocks of SmolLM2's shapes (the Q8_0
head, a Q5_0 FFN projection and a Q5_0 attention projection), at 1 and 8 activation rows:
the median of 30 calls after one warm-up, on a thread of its own, torch at one thread.

    python tools/linear_bench.py LABEL      # one line of figures; run it for each build
"""

from __future__ import annotations

import sys
import time

import torch

from slotserve.model.gguf_linear import pack
from slotserve.native import build_kernels
from slotserve.native.threads import on_own_thread
from slotserve.testing import random_gguf_rows

SHAPES = (("Q8_0", 49152, 576), ("Q5_0", 3072, 576), ("Q5_0", 576, 576))


def timings() -> dict[str, float]:
    kernel = build_kernels().blocks
    assert kernel is not None, "no block kernel on this machine"
    torch.manual_seed(0)
    figures = {}
    for kind, rows, width in SHAPES:
        weights = pack(torch.from_numpy(random_gguf_rows(kind, rows, width)), kind)
        for m in (1, 8):
            x = torch.randn(m, width)
            kernel.linear(x, kind, weights, width)
            times = []
            for _ in range(30):
                began = time.perf_counter()
                kernel.linear(x, kind, weights, width)
                times.append(time.perf_counter() - began)
            figures[f"{kind} {rows}x{width} m={m}"] = sorted(times)[len(times) // 2] * 1e3
    return figures


def main() -> None:
    torch.set_num_threads(1)
    label = sys.argv[1] if len(sys.argv) > 1 else "linear"
    figures = on_own_thread(timings)
    print(label, " · ".join(f"{name}: {ms:.3f} ms" for name, ms in figures.items()))


if __name__ == "__main__":
    main()
