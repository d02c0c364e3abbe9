"""Weight-only int8 linears (dynamic activation quantisation, fbgemm/x86 kernels).

Decode on a CPU is bound by reading weights; int8 weights read a quarter of the bytes.
Each output channel has its own scale; activations are quantised per call by the kernel.
They replace the dense projections behind the `Linear` seam; the model code is unchanged.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from slotserve.model.layers import DenseLinear, Linear
from slotserve.model.weights import LlamaWeights


def _has_vnni() -> bool:
    """Whether this CPU has an 8-bit dot product with 32-bit sums (AVX-512 VNNI or AVX-VNNI)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# Without VNNI, the x86 int8 kernels (fbgemm, oneDNN) sum pairs of u8 x s8 products in 16
# bits, which saturate on 8-bit activations; QNNPACK's kernels do not. A weight packed by an
# engine runs with that engine's kernels, so there the weights are packed by QNNPACK.
PACK_ENGINE = None if _has_vnni() else "qnnpack"


def _prepack(qweight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``qweight`` and ``bias`` packed for `Int8Linear` by `PACK_ENGINE` where it is set
    (torch's quantized engine is process-wide: set for the call, then restored)."""
    engine = PACK_ENGINE
    if engine is None or engine not in torch.backends.quantized.supported_engines:
        return torch.ops.quantized.linear_prepack(qweight, bias)
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        return torch.ops.quantized.linear_prepack(qweight, bias)
    finally:
        torch.backends.quantized.engine = before


@dataclass(frozen=True)
class Int8Linear:
    """``y ≈ x @ weight.T + bias`` with per-channel int8 weights."""

    packed: Any  # torch's prepacked int8 weight (opaque)
    out_features: int
    in_features: int
    has_bias: bool

    @classmethod
    def from_dense(cls, dense: DenseLinear) -> Int8Linear:
        weight = dense.weight.float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantised tensors are deprecated in torch's API
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = dense.bias.float() if dense.bias is not None else None
        packed = _prepack(qweight, bias)
        return cls(packed, weight.shape[0], weight.shape[1], bias is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(flat, self.packed)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        """int8 weights, one fp64 scale and one int64 zero point per output channel, bias."""
        per_channel = 8 + 8 + (4 if self.has_bias else 0)
        return self.out_features * (self.in_features + per_channel)


def _int8(linear: Linear) -> Linear:
    assert isinstance(linear, DenseLinear), "only dense weights can be quantised"
    return Int8Linear.from_dense(linear)


WEIGHT_FORMATS = ("fp32", "int8")


def quantize_int8(weights: LlamaWeights) -> LlamaWeights:
    """The same model with the Q/K/V, output, gate/up projections and the head in int8.

    The down projection stays fp32: its input (the SwiGLU product) has outliers that
    per-tensor activation quantisation cannot hold; quantising it too drops teacher-forced
    agreement with llama.cpp well below the other projections' (docs/BENCHMARKS.md).
    """
    layers = tuple(
        replace(layer, qkv=_int8(layer.qkv), o=_int8(layer.o), gate_up=_int8(layer.gate_up))
        for layer in weights.layers
    )
    return replace(weights, layers=layers, lm_head=_int8(weights.lm_head), tied=False)


def with_weights(weights: LlamaWeights, fmt: str) -> LlamaWeights:
    """``weights`` in format ``fmt`` ("fp32": as loaded, "int8": `quantize_int8`)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights={fmt!r} is not one of {WEIGHT_FORMATS}")
    return quantize_int8(weights) if fmt == "int8" else weights
