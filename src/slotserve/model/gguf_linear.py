"""Linears and embeddings on a GGUF file's own Q4_1 and Q8_0 blocks: the file's bytes,
packed in pairs of blocks for the kernel (`kernels/gguf_linear.c`).

Reading the weights is most of a CPU decode step; these read the file's 4.5 or 8.5 bits
per weight instead of a 32-bit copy, and multiply the way llama.cpp does (activations in
int8 blocks of 32 with their own scale, integer dot products per block), so the results
follow llama.cpp's. The products run on OpenMP threads, one per core. Where the kernel
cannot be built (no C compiler), `gguf_kernel` is None and `load` keeps dequantised
weights.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve.paths import load_library, process_cores

SOURCE = Path(__file__).with_name("kernels") / "gguf_linear.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BLOCK = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
KIND_CODES = {"Q4_1": 0, "Q8_0": 1}  # the kernel's names for them

_log = logging.getLogger(__name__)
_POINTER, _I64 = ctypes.c_void_p, ctypes.c_int64


class GGUFKernel:
    """The loaded kernel. Its products run on OpenMP threads (torch's runtime), one per
    core this process may use, unless ``threads_override`` is set."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.threads_override: int | None = None
        self._quantize = library.quantize_q8
        self._quantize.restype = None
        self._quantize.argtypes = [_POINTER, *(_I64,) * 3, *(_POINTER,) * 3]
        self._gemm = library.gemm
        self._gemm.restype = ctypes.c_int
        self._gemm.argtypes = [
            ctypes.c_int,
            _POINTER,
            *(_I64,) * 2,
            *(_POINTER,) * 3,
            _I64,
            _POINTER,
            _I64,
            ctypes.c_int,
        ]
        self._layer_in = library.layer_in
        self._layer_in.restype = ctypes.c_int
        self._layer_in.argtypes = [
            _POINTER, *(_I64,) * 2, _POINTER, ctypes.c_float, _POINTER, _POINTER,
            *(_I64,) * 2, *(_POINTER,) * 4, ctypes.c_int,
        ]  # fmt: skip
        self._layer_out = library.layer_out
        self._layer_out.restype = ctypes.c_int
        self._layer_out.argtypes = [
            _POINTER, *(_I64,) * 2, _POINTER, _I64, *(_POINTER,) * 2, ctypes.c_float,
            *(_POINTER,) * 4, ctypes.c_int,
        ]  # fmt: skip

    @property
    def threads(self) -> int:
        return self.threads_override or process_cores()

    def layer_in(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        qkv_weights: ctypes.Structure,
        qkv: torch.Tensor,
        rotated_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        scratch: ctypes.Structure,
    ) -> None:
        """``qkv = rope(rms_norm(x) W_qkv^T)``: see ``layer_in`` in the C source. All
        tensors are contiguous fp32 (``positions`` int64), sized by the caller."""
        status = self._layer_in(
            x.data_ptr(), x.shape[0], x.shape[1], norm.data_ptr(), eps,
            ctypes.byref(qkv_weights), qkv.data_ptr(), rotated_heads, head_dim,
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), ctypes.byref(scratch),
            self.threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"layer_in refused its arguments (x {tuple(x.shape)})")

    def layer_out(
        self,
        x: torch.Tensor,
        attn: torch.Tensor,
        o_weights: ctypes.Structure,
        norm: torch.Tensor,
        eps: float,
        gate_up_weights: ctypes.Structure,
        gate_up: torch.Tensor,
        down_weights: ctypes.Structure,
        scratch: ctypes.Structure,
    ) -> None:
        """``x += attn W_o^T``, then ``x += mlp(rms_norm(x))``, in place: see ``layer_out``
        in the C source."""
        status = self._layer_out(
            x.data_ptr(), x.shape[0], x.shape[1], attn.data_ptr(), attn.shape[1],
            ctypes.byref(o_weights), norm.data_ptr(), eps, ctypes.byref(gate_up_weights),
            gate_up.data_ptr(), ctypes.byref(down_weights), ctypes.byref(scratch),
            self.threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"layer_out refused its arguments (x {tuple(x.shape)})")

    def matmul(
        self, x: torch.Tensor, kind: str, packed: torch.Tensor, in_features: int
    ) -> torch.Tensor:
        """``x[m, k] @ W.T`` as ``[m, n]`` fp32, for ``W[n, k]`` of GGUF type ``kind`` in
        packed rows (`pack`)."""
        m, k = x.shape
        n = packed.shape[0]
        if k != in_features or packed.shape[1] != row_bytes(kind, k):
            raise ValueError(
                f"packed {kind} rows of shape {tuple(packed.shape)} and {in_features} "
                f"weights do not fit inputs of width {k}"
            )
        if x.dtype != torch.float32 or x.stride(1) != 1:
            x = x.float().contiguous()
        blocks = padded_blocks(k)
        q = torch.empty(m, blocks * BLOCK, dtype=torch.int8)
        scales = torch.empty(2, m, blocks)
        d, s = scales[0], scales[1]
        self._quantize(x.data_ptr(), m, k, x.stride(0), q.data_ptr(), d.data_ptr(), s.data_ptr())
        y = torch.empty(m, n)
        status = self._gemm(
            KIND_CODES[kind],
            packed.data_ptr(),
            n,
            k,
            q.data_ptr(),
            d.data_ptr(),
            s.data_ptr(),
            m,
            y.data_ptr(),
            n,
            self.threads,
        )
        if status != 0:
            raise ValueError(f"gemm refused {kind} [{n}, {k}] x [{m}, {k}]")
        return y


@functools.cache
def gguf_kernel() -> GGUFKernel | None:
    """The kernel for this machine, built on first use; None where it cannot be built."""
    try:
        library = load_library(SOURCE, FLAGS)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        _log.warning("GGUF block kernel unavailable (%s); weights load dequantised", detail)
        return None
    return GGUFKernel(library)


def dedicate_cores_to_kernels() -> None:
    """For a process that serves block weights: torch's own ops run on one thread (call
    it before any torch work, which starts torch's threads).

    A block-weight step's torch ops are tiny, and the kernels make ~150 OpenMP parallel
    regions a step. With torch's threads as well, libgomp manages more threads than there
    are cores and stops spinning between regions, so every region waits for a sleeping
    thread to wake: the bundled model served 53 tok/s instead of 102 (Intel Xeon, 2 cores).
    """
    torch.set_num_threads(1)


def require_kernel() -> GGUFKernel:
    kernel = gguf_kernel()
    if kernel is None:
        raise RuntimeError(
            "GGUF block weights need the compiled kernel, which could not be built (see "
            "the warning above); install a C compiler (cc) or load with weights='fp32'"
        )
    return kernel


def padded_blocks(in_features: int) -> int:
    """Blocks of a packed row: ``in_features / 32`` rounded up to pairs."""
    return (in_features // BLOCK + 1) // 2 * 2


def row_bytes(kind: str, in_features: int) -> int:
    return padded_blocks(in_features) * BLOCK_BYTES[kind]


def pack(gguf_rows: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF matrix's rows (``[rows, in / 32 · block bytes]`` uint8, Q4_1 or Q8_0 blocks)
    in the kernel's packed layout (see the C source): the same bytes, moved."""
    rows = gguf_rows.shape[0]
    grouped = gguf_rows.reshape(rows, -1, BLOCK_BYTES[kind])
    if grouped.shape[1] % 2:  # a zero block pads the row to pairs
        grouped = torch.cat([grouped, grouped.new_zeros(rows, 1, BLOCK_BYTES[kind])], dim=1)
    pairs = grouped.shape[1] // 2
    scale = grouped[:, :, 0:2].reshape(rows, -1)
    if kind == "Q4_1":
        nibbles = grouped[:, :, 4:].reshape(rows, -1)
        return torch.cat([nibbles, scale, grouped[:, :, 2:4].reshape(rows, -1)], dim=1)
    values = grouped[:, :, 2:].reshape(rows, pairs, 2, 2, 16)  # [pair, block, half, 16]
    values = values.transpose(2, 3).reshape(rows, -1)  # pair order: [pair, half, block, 16]
    return torch.cat([values, scale], dim=1)


def unpack(packed: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """The fp32 weights ``[rows, in_features]`` of packed rows."""
    rows, blocks = packed.shape[0], padded_blocks(in_features)
    if kind == "Q4_1":
        nibbles = packed[:, : blocks * 16].reshape(rows, blocks, 16)
        halves = packed[:, blocks * 16 :].contiguous().view(torch.float16).float()
        scale, offset = halves[:, :blocks, None], halves[:, blocks:, None]
        values = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2).float() * scale + offset
    else:
        ints = packed[:, : blocks * 32].contiguous().view(torch.int8)
        ints = ints.reshape(rows, blocks // 2, 2, 2, 16).transpose(2, 3)  # back to blocks
        scale = packed[:, blocks * 32 :].contiguous().view(torch.float16).float()
        values = ints.reshape(rows, blocks, BLOCK).float() * scale[:, :, None]
    return values.reshape(rows, -1)[:, :in_features]


@dataclass(frozen=True)
class BlockLinear:
    """``y = x @ W.T`` for ``W[out_features, in_features]`` held in a GGUF file's Q4_1 or
    Q8_0 blocks, packed for the kernel (`pack`; `from_gguf` takes the file's rows, and
    `to_q4_1` turns Q4_0 rows into Q4_1 ones, exactly)."""

    packed: torch.Tensor
    kind: str
    in_features: int
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"kind={self.kind!r} is not one of {tuple(BLOCK_BYTES)}")
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"in_features={self.in_features} must be a positive multiple of 32")
        width = row_bytes(self.kind, self.in_features)
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(f"packed rows must be 2-D uint8, got {self.packed.dtype}")
        if self.packed.shape[1] != width:
            raise ValueError(
                f"packed {self.kind} rows of {self.in_features} weights are {width} bytes, "
                f"got {self.packed.shape[1]}"
            )

    @classmethod
    def from_gguf(cls, gguf_rows: torch.Tensor, kind: str) -> BlockLinear:
        """From a GGUF matrix's rows, ``[out_features, in_features / 32 · block bytes]``."""
        if kind not in BLOCK_BYTES:
            raise ValueError(f"kind={kind!r} is not one of {tuple(BLOCK_BYTES)}")
        if gguf_rows.shape[1] % BLOCK_BYTES[kind]:
            raise ValueError(
                f"{kind} rows are whole {BLOCK_BYTES[kind]}-byte blocks, got "
                f"{gguf_rows.shape[1]} bytes"
            )
        in_features = gguf_rows.shape[1] // BLOCK_BYTES[kind] * BLOCK
        return cls(pack(gguf_rows, kind), kind, in_features)

    def rows(self, order: torch.Tensor) -> BlockLinear:
        """The same matrix with its rows in ``order``."""
        return BlockLinear(self.packed[order].contiguous(), self.kind, self.in_features, self.bias)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.shape
        flat = x.reshape(-1, in_features)
        y = require_kernel().matmul(flat, self.kind, self.packed, in_features)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weights (of ``rows`` only, if given): ``[len(rows), in_features]``."""
        packed = self.packed if rows is None else torch.index_select(self.packed, 0, rows)
        return unpack(packed, self.kind, self.in_features)


@dataclass(frozen=True)
class BlockEmbedding:
    """The token embedding on the same blocks (a tied head shares them): indexing with
    token ids gives their fp32 rows, as indexing a dense table does."""

    table: BlockLinear

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize(tokens.reshape(-1)).reshape(*tokens.shape, -1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.table.shape

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


def to_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows (``[rows, n · 18]``: fp16 d, 16 bytes of nibbles; ``w = d · (u - 8)``) as
    the same weights in Q4_1 rows (``m = -8 · d``, exact in fp16)."""
    grouped = blocks.reshape(blocks.shape[0], -1, 18)
    scale = grouped[:, :, 0:2].contiguous().view(torch.float16)
    offset = (scale * -8).view(torch.uint8)
    return torch.cat([grouped[:, :, 0:2], offset, grouped[:, :, 2:]], dim=2).reshape(
        blocks.shape[0], -1
    )
