"""Time the block kernel's `linear` alone on random blocks of SmolLM2's shapes (the Q8_0
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

BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_1": 20}
SHAPES = (("Q8_0", 49152, 576), ("Q5_0", 3072, 576), ("Q5_0", 576, 576))


def random_rows(kind: str, rows: int, width: int) -> torch.Tensor:
    """GGUF rows of random blocks whose fp16 scales (and Q4_1 mins) are 2^-7, packed."""
    blocks = torch.randint(0, 256, (rows, width // 32, BLOCK_BYTES[kind]), dtype=torch.uint8)
    blocks[:, :, 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)
    if kind == "Q4_1":
        blocks[:, :, 2:4] = torch.tensor([0x00, 0x20], dtype=torch.uint8)
    return pack(blocks.reshape(rows, -1).contiguous(), kind)


def timings() -> dict[str, float]:
    kernel = build_kernels().blocks
    assert kernel is not None, "no block kernel on this machine"
    torch.manual_seed(0)
    figures = {}
    for kind, rows, width in SHAPES:
        weights = random_rows(kind, rows, width)
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
