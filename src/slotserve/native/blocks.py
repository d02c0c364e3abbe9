"""Binding of ``csrc/blocks.c``: products with a GGUF file's weight blocks (each type's
rows interleaved in groups of 8; see ``csrc/quants.h``), and a transformer layer's work
around its attention in two calls (`BlockKernel.layer_in`, `BlockKernel.layer_out`), or a
step's layers, their attention between, in one (`BlockKernel.layer_stack`).

`BLOCK_TYPES` is the one table of the weight types the kernel takes (code, block size,
layout); the C enum and tables, the packer (`slotserve.model.gguf_linear`) and the ctypes
structs read or are checked against it.

Every call takes one struct (`LinearArgs`, `LayerInArgs`, `LayerOutArgs`, `StackArgs`,
built of `Matrix` and `Scratch`), mirrored field for field by the C source; a test
compares their layouts.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from slotserve.native.abi import layout_mismatch

BLOCK = 32  # values in a block of the 32-value types, and in an activation block
SUPER = 256  # values in a K-quant super-block
GROUP = 8  # rows interleaved in a matrix (every type: gguf_linear.pack)
# A segment's word size that marks the Q5_0/Q5_1 fifth bits, interleaved as bit masks
# rather than words (`slotserve.model.gguf_linear`).
FIFTH_BITS = 0


@dataclass(frozen=True)
class BlockType:
    """The type facts of one GGUF weight type the block kernel multiplies, in one place.

    ``name``: gguf's ``GGMLQuantizationType`` name. ``code``: the kernel's ``KIND_*`` in
    ``csrc/quants.h`` (what `Matrix.kind` holds). ``values`` and ``size``: weights and bytes
    of one block (a super-block for the K-quants), as gguf's ``GGML_QUANT_SIZES`` has them.
    ``segments``: the kernel's layout of one block of a group of t rows: these byte ranges
    ``(start, end, word)`` of each row's file block, one after another in the order the
    kernel reads them, each as ``[words][t][word]`` (lane n of a vector is row n's word),
    or, with word `FIFTH_BITS`, as 8 masks of 4t bits (mask 2c + h, bit 4n + i: bit
    16h + 4c + i of row n's). They cover the block's bytes once each.

    ``tests/native/test_block_types.py`` checks ``quants.h``'s enum and tables, and gguf's
    sizes, against `BLOCK_TYPES`."""

    name: str
    code: int
    values: int
    size: int
    segments: tuple[tuple[int, int, int], ...]


# A Q6_K super-block's weights come as the kernel takes them, 64 at a time: 16 bytes of
# ql's low half, 16 of its high half and 16 of qh.
_Q6_K_WEIGHTS = tuple(
    (start, start + 16, 4)
    for h in range(2)
    for q in range(2)
    for start in (64 * h + 16 * q, 64 * h + 32 + 16 * q, 128 + 32 * h + 16 * q)
)
BLOCK_TYPES: tuple[BlockType, ...] = (
    BlockType("Q4_1", 0, BLOCK, 20, ((4, 20, 4), (0, 2, 2), (2, 4, 2))),
    BlockType("Q8_0", 1, BLOCK, 34, ((2, 34, 4), (0, 2, 2))),
    BlockType("Q5_0", 2, BLOCK, 22, ((6, 22, 4), (2, 6, FIFTH_BITS), (0, 2, 2))),
    BlockType("Q5_1", 3, BLOCK, 24, ((8, 24, 4), (4, 8, FIFTH_BITS), (0, 2, 2), (2, 4, 2))),
    BlockType("Q4_K", 4, SUPER, 144, ((4, 16, 4), (0, 2, 2), (2, 4, 2), (16, 144, 4))),
    BlockType("Q5_K", 5, SUPER, 176, ((4, 16, 4), (0, 2, 2), (2, 4, 2), (16, 48, 4), (48, 176, 4))),
    BlockType("Q6_K", 6, SUPER, 210, ((192, 208, 4), *_Q6_K_WEIGHTS, (208, 210, 2))),
)
# Views of `BLOCK_TYPES` by name: (values, bytes) of a block, its bytes, the kernel's code,
# and the layout's segments.
BLOCK_SIZES = {t.name: (t.values, t.size) for t in BLOCK_TYPES}
BLOCK_BYTES = {t.name: t.size for t in BLOCK_TYPES}
KIND_CODES = {t.name: t.code for t in BLOCK_TYPES}
SEGMENTS = {t.name: t.segments for t in BLOCK_TYPES}

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` values (a matrix of n rows holds n times
    that, interleaved or not)."""
    values, size = BLOCK_SIZES[kind]
    return in_features // values * size


class Matrix(ctypes.Structure):
    """A matrix as the kernel takes it: its rows' blocks, GGUF type code, row count, and
    ``next``, the address of the matrix holding the rows after these (0: none)."""

    _fields_ = [("blocks", _P), ("kind", _I64), ("rows", _I64), ("next", _P)]

    @classmethod
    def of(cls, packed: torch.Tensor, kind: str) -> Matrix:
        return cls(packed.data_ptr(), KIND_CODES[kind], packed.shape[0], None)

    @classmethod
    def chain(cls, parts: list[tuple[torch.Tensor, str]]) -> Matrix:
        """The rows of ``parts`` (blocks, type) one after another, as one matrix. The head
        keeps the rest alive: the kernel follows ``next`` by address."""
        rest = cls.chain(parts[1:]) if len(parts) > 1 else None
        head = cls.of(*parts[0])
        if rest is not None:
            head.next = ctypes.addressof(rest)
            head.rest = rest
        return head


class Scratch(ctypes.Structure):
    """A step's work space: ``h[m, widest]`` fp32, ``q[m, widest]`` int8, ``d, s`` (a
    scale a block of 32) and ``sums`` (int16, one per 16 values)."""

    _fields_ = [(name, _P) for name in ("h", "q", "d", "s", "sums")]


class LinearArgs(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("m", _I64), ("k", _I64), ("ldx", _I64), ("w", Matrix), ("y", _P),
        ("ldy", _I64), ("tmp", Scratch), ("threads", _I64),
    ]  # fmt: skip


class LayerInArgs(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("m", _I64), ("dim", _I64), ("norm", _P), ("eps", _F32), ("qkv_w", Matrix),
        ("qkv", _P), ("rotated", _I64), ("head_dim", _I64), ("cos", _P), ("sin", _P),
        ("q_norm", _P), ("k_norm", _P), ("q_heads", _I64), ("tmp", Scratch), ("threads", _I64),
    ]  # fmt: skip


class LayerOutArgs(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("m", _I64), ("dim", _I64), ("attn", _P), ("attn_width", _I64),
        ("o_w", Matrix), ("norm", _P), ("eps", _F32), ("gate_up_w", Matrix), ("gate_up", _P),
        ("down_w", Matrix), ("post_attn_norm", _P), ("post_ffn_norm", _P), ("gelu", _I64),
        ("tmp", Scratch), ("threads", _I64),
    ]  # fmt: skip


class StackArgs(ctypes.Structure):
    """A step's layers in one call: per layer, the addresses of its `LayerInArgs`, its
    attention's arguments (the attention library's, opaque here) and its `LayerOutArgs`,
    and the attention function's address."""

    _fields_ = [
        ("layers", _I64), ("ins", _P), ("attends", _P), ("outs", _P), ("attend", _P),
    ]  # fmt: skip


class NormArgs(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("m", _I64), ("dim", _I64), ("weight", _P), ("eps", _F32), ("out", _P),
    ]  # fmt: skip


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "norm_args": NormArgs,
    "matrix": Matrix,
    "scratch": Scratch,
    "linear_args": LinearArgs,
    "layer_in_args": LayerInArgs,
    "layer_out_args": LayerOutArgs,
    "stack_args": StackArgs,
}


class ScratchSpace:
    """The tensors behind a `Scratch` for steps of ``m`` rows of width up to ``widest``:
    the activations' int8 blocks and scales, and (``rows``, for the layer calls) ``h``,
    the fp32 rows between a layer's products (a lone product needs none)."""

    def __init__(self, m: int, widest: int, *, rows: bool = True) -> None:
        blocks = -(-widest // BLOCK)
        self.h = torch.empty(m, widest) if rows else None
        self.q = torch.empty(m, blocks * BLOCK, dtype=torch.int8)
        self.scales = torch.empty(2, m, blocks)
        self.sums = torch.empty(m, blocks * 2, dtype=torch.int16)
        self.struct = Scratch(
            self.h.data_ptr() if self.h is not None else None,
            self.q.data_ptr(),
            self.scales[0].data_ptr(),
            self.scales[1].data_ptr(),
            self.sums.data_ptr(),
        )


class BlockKernel:
    """The loaded block kernel; its calls run on ``threads`` OpenMP threads."""

    def __init__(self, library: ctypes.CDLL, threads: int) -> None:
        for name, mirror in STRUCTS.items():
            if mismatch := layout_mismatch(library, name, mirror):
                raise OSError(f"block kernel ABI differs from its binding: {mismatch}")
        self._linear, self._layer_in, self._layer_out, self._norm, self._stack = (
            library.linear,
            library.layer_in,
            library.layer_out,
            library.norm,
            library.layer_stack,
        )
        for function in (self._linear, self._layer_in, self._layer_out, self._norm, self._stack):
            function.restype, function.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.threads = threads

    def linear(
        self, x: torch.Tensor, kind: str, packed: torch.Tensor, in_features: int
    ) -> torch.Tensor:
        """``x[m, k] @ W.T`` as ``[m, n]`` fp32, for ``W[n, k]`` of GGUF type ``kind`` in
        the kernel's rows (`slotserve.model.gguf_linear.pack`)."""
        k, n = x.shape[1], packed.shape[0]
        if k != in_features or packed.shape[1] != row_bytes(kind, k):
            raise ValueError(
                f"packed {kind} rows of shape {tuple(packed.shape)} and {in_features} "
                f"weights do not fit inputs of width {k}"
            )
        return self.multiply(x, Matrix.of(packed, kind), n)

    def multiply(self, x: torch.Tensor, matrix: Matrix, out_features: int) -> torch.Tensor:
        """``x[m, k]`` times a `Matrix` (a chain's parts side by side) of ``out_features``
        rows in all, as ``[m, out_features]`` fp32."""
        if x.dtype != torch.float32 or x.stride(1) != 1:
            x = x.float().contiguous()
        m, k = x.shape
        scratch = ScratchSpace(m, k, rows=False)
        y = torch.empty(m, out_features)
        args = LinearArgs(
            x.data_ptr(), m, k, x.stride(0), matrix, y.data_ptr(), out_features,
            scratch.struct, self.threads,
        )  # fmt: skip
        if self._linear(ctypes.byref(args)) != 0:
            raise ValueError(f"linear refused [{out_features}, {k}] x [{m}, {k}]")
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of ``x[m, dim]`` (fp32, contiguous) times ``weight[dim]``,
        as the layer calls compute it (the same operations in the same order for any m)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        weight = weight.float().contiguous()
        out = torch.empty_like(x)
        args = NormArgs(
            x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr()
        )
        self._norm(ctypes.byref(args))
        return out

    def layer_in(self, args: LayerInArgs) -> None:
        """``qkv = rope(rms_norm(x) W_qkv^T)``: see ``layer_in_args`` in the C source."""
        if self._layer_in(ctypes.byref(args)) != 0:
            raise ValueError(f"layer_in refused its arguments ({args.m} rows of {args.dim})")

    def layer_out(self, args: LayerOutArgs) -> None:
        """``x += attn W_o^T``, then ``x += mlp(rms_norm(x))``, in place: see
        ``layer_out_args`` in the C source."""
        if self._layer_out(ctypes.byref(args)) != 0:
            raise ValueError(f"layer_out refused its arguments ({args.m} rows of {args.dim})")

    def layer_stack(self, args: StackArgs) -> None:
        """Every layer of a step: ``layer_in``, the attention, ``layer_out``, in turn, each
        on its own arguments (see ``layer_stack`` in the C source)."""
        if (code := self._stack(ctypes.byref(args))) != 0:
            layer, call = divmod(-code - 1, 3)
            name = ("layer_in", "the attention", "layer_out")[call]
            raise ValueError(f"{name} of layer {layer} refused its arguments in a step's stack")
