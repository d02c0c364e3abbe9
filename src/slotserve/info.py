"""`ModelInfo`: the shape of a Llama-family model, independent of the file it came from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

ACTIVATIONS = ("silu", "gelu_tanh")
# How an embedding is pooled from the final hidden states: their mean, the first token's
# (llama.cpp's CLS) or the last token's.
Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[Pooling, ...] = get_args(Pooling)
# The positions a RoPE table computes at once (`slotserve.model.layers.RopeTables`).
ROPE_CHUNK = 1024


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    ``scaling`` is ``"none"``, ``"linear"`` or ``"llama3"``; the llama3 fields follow the
    Hugging Face ``rope_scaling`` dict of the same names.
    """

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.scaling not in ("none", "linear", "llama3"):
            raise ValueError(
                f"rope scaling {self.scaling!r} is not supported; use none, linear or llama3"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelInfo:
    """Everything the runtime needs to know about a model's shape.

    ``sliding_window[i]`` is the attention window of layer ``i`` (``None`` = full attention):
    a query at position p sees keys at positions ``p - window + 1 .. p``.

    The Gemma 3 family differs from Llama's in four facts, each a field: its sliding-window
    layers rotate by their own RoPE (``rope_local``), every attention and MLP output is
    RMS-normed before its residual (``post_norms``), the MLP's gate is GELU's tanh form
    (``activation``), and embeddings are scaled by √dim (``embed_scale``).
    """

    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_context: int
    norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: tuple[int | None, ...] = ()
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    name: str = ""
    rope_local: RopeConfig | None = None
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    pooling: Pooling | None = None  # the model's own embedding pooling, where it names one

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling {self.pooling!r} is not one of {POOLINGS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ModelInfo.activation {self.activation!r} is not one of {ACTIVATIONS}"
            )
        if not self.embed_scale > 0:
            raise ValueError(f"ModelInfo.embed_scale must be > 0, got {self.embed_scale}")
        for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelInfo.{name} must be > 0, got {getattr(self, name)}")
        if self.vocab_size <= 0 or self.max_context <= 0:
            raise ValueError("ModelInfo.vocab_size and max_context must be > 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.sliding_window and len(self.sliding_window) != self.n_layers:
            raise ValueError(
                f"sliding_window has {len(self.sliding_window)} entries for {self.n_layers} layers"
            )

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or ``None`` for full attention."""
        return self.sliding_window[layer] if self.sliding_window else None

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates by ``rope_local`` (a sliding-window layer of a model
        that has one) rather than ``rope``."""
        return self.rope_local is not None and self.window(layer) is not None

    def rope_table_bytes(self, positions: int) -> int:
        """Bytes of the RoPE tables a model of this shape holds once its steps reached
        ``positions`` positions (`slotserve.model.layers.RopeTables`): cos and sin rows of
        ``head_dim`` fp32 values, `ROPE_CHUNK` positions at a time, for ``rope`` and, where
        the model has one, ``rope_local``."""
        chunks = -(-min(positions, self.max_context) // ROPE_CHUNK)
        tables = 1 if self.rope_local is None else 2
        return tables * 2 * chunks * ROPE_CHUNK * self.head_dim * 4

    @property
    def kv_dim(self) -> int:
        """Width of one K (or V) row for one position in one layer."""
        return self.n_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V that one position costs across all layers."""
        return 2 * self.n_layers * self.kv_dim * dtype_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelInfo:
        fields: dict[str, Any] = json.loads(text)
        fields["rope"] = RopeConfig(**fields["rope"])
        if fields.get("rope_local") is not None:
            fields["rope_local"] = RopeConfig(**fields["rope_local"])
        fields["sliding_window"] = tuple(fields["sliding_window"])
        fields["eos_ids"] = tuple(fields["eos_ids"])
        return cls(**fields)
