"""A GGUF file's metadata as text, its `ModelInfo`, and its dequantised tensors.

The container is read by `slotserve.artifact.gguf_reader`. Every way a file can be wrong
(bad magic, a declared size beyond the file, truncated tensor data, a string that is not
UTF-8, missing keys, unknown quantisation or architecture) becomes an `ArtifactError`
naming the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from gguf.quants import dequantize

from slotserve.artifact.gguf_reader import GGUFFile, GGUFTensor, read_gguf, utf8_error
from slotserve.artifact.gguf_tokenizer import TOKENS_KEY
from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo, Pooling, RopeConfig
from slotserve.model.gguf_linear import BlockLinear, to_q4_1
from slotserve.native.blocks import BLOCK_TYPES

WeightT = TypeVar("WeightT", torch.Tensor, BlockLinear)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# RoPE tables for the whole context are built at load, so a corrupt context length would
# allocate without bound; 2**24 positions is beyond every model we read.
MAX_CONTEXT = 1 << 24
SUPPORTED_QUANTS = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
)
# Gemma 3 runs one local (sliding-window) layer pattern: five local layers to one global,
# unless the file lists them (llama.cpp's default for the architecture).
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's layers norm after attention and after the MLP as well: its GGUF ``ffn_norm`` is
# the norm before the MLP (Hugging Face ``pre_feedforward_layernorm``).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: Path) -> GGUFFile:
    """Read ``path``'s header, metadata and tensor table (`gguf_reader.read_gguf`: every
    declared size checked against the file, every tensor inside it)."""
    return read_gguf(path)


def read_metadata(gguf: GGUFFile) -> dict[str, Any]:
    """All key/value metadata as plain Python values, every string UTF-8 text.

    A string that is not UTF-8 (a value, or an element of an array) is an `ArtifactError`
    naming the key, the element's index and the first invalid byte; the one exception is
    ``tokenizer.ggml.tokens``, whose token texts stay as the file has them (`str`, or the
    file's `bytes` where they are not UTF-8): llama.cpp keeps token texts as bytes, and
    whether such a token can be kept is the tokenizer's to decide
    (`slotserve.artifact.gguf_tokenizer`)."""
    for key, value in gguf.metadata.items():
        if key == TOKENS_KEY:
            continue
        if isinstance(value, bytes):
            raise ArtifactError(gguf.path, f"is not UTF-8 text ({utf8_error(value)})", key)
        if isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, bytes):
                    raise ArtifactError(
                        gguf.path,
                        f"element {index} is not UTF-8 text ({utf8_error(item)})",
                        key,
                    )
    return dict(gguf.metadata)


def tensor_shapes(reader: GGUFFile) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, outermost dimension first (as torch and Hugging Face order it)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def model_info_from_gguf(
    meta: dict[str, Any],
    tensor_names: Collection[str],
    path: Path,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> ModelInfo:
    """`ModelInfo` from ``{arch}.*`` keys (tied embeddings: no ``output.weight`` tensor).

    Every value is checked before anything is sized from it: counts at least 1, heads that
    divide, finite positive floats, token ids inside the vocabulary, a block count that
    matches the ``blk.N`` tensors and (given ``shapes``) an embedding table of the stated
    width and vocabulary. A failure is an `ArtifactError` naming the key.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ArtifactError(
            path,
            f"architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}",
            "general.architecture",
        )
    n_layers = _count(meta, f"{arch}.block_count", path)
    _check_blocks(n_layers, tensor_names, f"{arch}.block_count", path)
    dim = _count(meta, f"{arch}.embedding_length", path)
    n_heads, n_kv_heads, head_dim = _heads(meta, arch, dim, path)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab_key = f"{arch}.vocab_size" if f"{arch}.vocab_size" in meta else "tokenizer.ggml.tokens"
    vocab_size = _count(meta, f"{arch}.vocab_size", path, len(tokens))
    if shapes is not None:
        _check_embedding(shapes, dim, (vocab_key, vocab_size), f"{arch}.embedding_length", path)
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None:
        window = _count(meta, f"{arch}.attention.sliding_window", path)
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", vocab_size, path)
    eot = _token_id(meta, "tokenizer.ggml.eot_token_id", vocab_size, path)
    gemma = arch == "gemma3"
    eos_ids = tuple(dict.fromkeys(t for t in (eos, eot) if t is not None))
    if gemma and "<end_of_turn>" in tokens:  # llama.cpp ends generation there too
        eos_ids = tuple(dict.fromkeys((*eos_ids, tokens.index("<end_of_turn>"))))
    windows = _gemma3_windows(meta, n_layers, window, path) if gemma else None
    return ModelInfo(
        arch=str(arch),
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=_count(meta, f"{arch}.feed_forward_length", path),
        vocab_size=vocab_size,
        max_context=_count(meta, f"{arch}.context_length", path, ceiling=MAX_CONTEXT),
        norm_eps=_positive(meta, f"{arch}.attention.layer_norm_rms_epsilon", path),
        rope=_rope_from_gguf(meta, arch, path),
        tied_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        sliding_window=windows if windows is not None else (window,) * n_layers if window else (),
        bos_id=_token_id(meta, "tokenizer.ggml.bos_token_id", vocab_size, path),
        eos_ids=eos_ids,
        name=str(meta.get("general.name", path.stem)),
        rope_local=(
            RopeConfig(_positive(meta, f"{arch}.rope.freq_base_swa", path, GEMMA3_LOCAL_ROPE_BASE))
            if gemma and window
            else None
        ),
        post_norms=gemma,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(dim) if gemma else 1.0,
        pooling=_pooling(meta, f"{arch}.pooling_type", path),
    )


# llama.cpp's `llama_pooling_type`: 0 none, 1 mean, 2 CLS, 3 last, 4 rank (a reranker's).
GGUF_POOLING: dict[int, Pooling | None] = {0: None, 1: "mean", 2: "cls", 3: "last"}


def _pooling(meta: Mapping[str, Any], key: str, path: Path) -> Pooling | None:
    """The embedding pooling the file names (None where it names none)."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in GGUF_POOLING:
        raise ArtifactError(
            path,
            f"{key}={value!r} is not a pooling this runtime implements: 0 (none), 1 (mean), "
            "2 (cls) or 3 (last); 4 (rank) is a reranker's, which is not served here",
            key,
        )
    return GGUF_POOLING[value]


def _gemma3_windows(
    meta: Mapping[str, Any], n_layers: int, window: int | None, path: Path
) -> tuple[int | None, ...]:
    """Each Gemma 3 layer's window: ``sliding_window_pattern`` as a list of booleans (one
    per layer) or a period N (layer i is local unless i % N == N - 1), default 6."""
    if window is None:
        return ()
    key = "gemma3.attention.sliding_window_pattern"
    pattern = meta.get(key, GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, (bool, int)) for p in pattern):
            raise ArtifactError(path, f"lists {len(pattern)} layers for {n_layers}", key)
        return tuple(window if p else None for p in pattern)
    period = _count(meta, key, path, GEMMA3_SWA_PATTERN)
    return tuple(window if i % period < period - 1 else None for i in range(n_layers))


def _count(
    meta: Mapping[str, Any], key: str, path: Path, default: int | None = None, *, ceiling: int = 0
) -> int:
    """An integer at least 1 (and at most ``ceiling`` when given); absent: ``default``."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArtifactError(path, f"missing or not an integer (got {value!r})", key)
    if value < 1:
        raise ArtifactError(path, f"is {value}; must be at least 1", key)
    if ceiling and value > ceiling:
        raise ArtifactError(
            path, f"is {value}; at most {ceiling} is supported (corrupt file?)", key
        )
    return value


def _positive(meta: Mapping[str, Any], key: str, path: Path, default: float | None = None) -> float:
    """A finite float > 0; absent: ``default``."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArtifactError(path, f"missing or not a number (got {value!r})", key)
    if not math.isfinite(value) or value <= 0:
        raise ArtifactError(path, f"is {value}; must be > 0 and finite", key)
    return float(value)


def _heads(meta: Mapping[str, Any], arch: str, dim: int, path: Path) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)``: KV heads divide the heads, and without an
    explicit key length the heads divide the width."""
    n_heads = _count(meta, f"{arch}.attention.head_count", path)
    n_kv_heads = _count(meta, f"{arch}.attention.head_count_kv", path, n_heads)
    if n_heads % n_kv_heads:
        raise ArtifactError(
            path,
            f"head_count_kv={n_kv_heads} does not divide head_count={n_heads}",
            f"{arch}.attention.head_count_kv",
        )
    key_length = f"{arch}.attention.key_length"
    if key_length in meta:
        return n_heads, n_kv_heads, _count(meta, key_length, path)
    if dim % n_heads:
        raise ArtifactError(
            path,
            f"head_count={n_heads} does not divide embedding_length={dim} and there is no "
            f"{key_length} to give the head width",
            f"{arch}.attention.head_count",
        )
    return n_heads, n_kv_heads, dim // n_heads


def _check_blocks(n_layers: int, tensor_names: Collection[str], key: str, path: Path) -> None:
    """The ``blk.N`` tensors are exactly blocks 0 .. n_layers-1."""
    blocks = {int(name.split(".")[1]) for name in tensor_names if _is_block_tensor(name)}
    beyond = sorted(b for b in blocks if b >= n_layers)
    if beyond:
        raise ArtifactError(
            path, f"is {n_layers} but the file has tensors for blk.{beyond[0]}", key
        )
    if len(blocks) < n_layers:
        raise ArtifactError(
            path,
            f"is {n_layers} but the file has tensors for {len(blocks)} blocks",
            key,
        )


def _is_block_tensor(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()


def _check_embedding(
    shapes: Mapping[str, tuple[int, ...]],
    dim: int,
    vocab: tuple[str, int],
    dim_key: str,
    path: Path,
) -> None:
    """``token_embd.weight`` is ``[vocabulary, width]`` as the metadata states them."""
    shape = shapes.get("token_embd.weight")
    if shape is None:
        raise ArtifactError(path, "tensor missing", "token_embd.weight")
    if len(shape) != 2 or shape[1] != dim:
        raise ArtifactError(path, f"is {dim} but token_embd.weight has shape {shape}", dim_key)
    vocab_key, vocab_size = vocab
    if shape[0] != vocab_size:
        raise ArtifactError(
            path, f"vocabulary of {vocab_size} but token_embd.weight has shape {shape}", vocab_key
        )


def _token_id(meta: Mapping[str, Any], key: str, vocab_size: int, path: Path) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ArtifactError(
            path, f"token id {value!r} is outside the vocabulary of {vocab_size}", key
        )
    return value


def _rope_from_gguf(meta: Mapping[str, Any], arch: str, path: Path) -> RopeConfig:
    theta = _positive(meta, f"{arch}.rope.freq_base", path, 10000.0)
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return RopeConfig(theta, "linear", _positive(meta, f"{arch}.rope.scaling.factor", path))
    return RopeConfig(theta)


def hf_tensor_name(name: str, path: Path, arch: str = "llama") -> str:
    """Map a GGUF tensor name to its Hugging Face name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    raise ArtifactError(path, f"unexpected tensor name for a {arch} model", name)


def iter_tensors(
    reader: GGUFFile, info: ModelInfo, path: Path, *, keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockLinear]]:
    """Yield ``(hf_name, fp32 tensor)`` for every tensor, dequantised and un-permuted. With
    ``keep_blocks``, the matrices in a type the block kernel multiplies (`BLOCK_KINDS`)
    come as `BlockLinear` on the file's blocks instead (rows un-permuted, Q4_0 as Q4_1)."""
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_QUANTS:
            raise ArtifactError(
                path,
                f"tensor type {kind} is not supported; supported: {SUPPORTED_QUANTS}",
                tensor.name,
            )
        name = hf_tensor_name(tensor.name, path, info.arch)
        if keep_blocks and kind in BLOCK_KINDS and len(tensor.shape) == 2:
            yield name, _unpermute(name, _blocks(tensor), info)
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))
        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            array = array.reshape(shape)
        except (ValueError, NotImplementedError) as exc:
            raise ArtifactError(
                path, f"cannot dequantise {kind} data ({exc})", tensor.name
            ) from exc
        yield name, _unpermute(name, torch.from_numpy(array.copy()), info)


# The block kernel's types (`slotserve.native.blocks.BLOCK_TYPES`), and Q4_0, which loads
# as Q4_1 (`to_q4_1`).
BLOCK_KINDS = ("Q4_0", *(t.name for t in BLOCK_TYPES))


def has_block_matrices(path: Path) -> bool:
    """Whether the file's layers hold matrices in a type the block kernel multiplies (the
    tensor table alone is read: the metadata's values are skipped)."""
    reader = read_gguf(path, values=False)
    return any(
        t.name.startswith("blk.") and len(t.shape) == 2 and t.tensor_type.name in BLOCK_KINDS
        for t in reader.tensors
    )


def _blocks(tensor: GGUFTensor) -> BlockLinear:
    """A 2-D tensor's blocks (of a `BLOCK_KINDS` type), copied out of the file's mapping."""
    rows = int(tensor.shape[1])
    data = torch.from_numpy(np.asarray(tensor.data).view(np.uint8).reshape(rows, -1).copy())
    if tensor.tensor_type.name == "Q4_0":
        return BlockLinear.from_gguf(to_q4_1(data), "Q4_1")
    return BlockLinear.from_gguf(data, tensor.tensor_type.name)


def _unpermute(name: str, weight: WeightT, info: ModelInfo) -> WeightT:
    # llama.cpp's converter interleaves the two rotary halves of each Q/K head for the
    # "llama" architecture (GGML's rope pairs adjacent dims). Undo it so the model can use
    # the rotate-half layout of the Hugging Face weights for every source. Rows are
    # independent, so a block matrix's rows move the same way.
    if info.arch != "llama":
        return weight
    if name.endswith("self_attn.q_proj.weight"):
        heads = info.n_heads
    elif name.endswith("self_attn.k_proj.weight"):
        heads = info.n_kv_heads
    else:
        return weight
    order = torch.arange(heads * info.head_dim)
    order = order.view(heads, info.head_dim // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, BlockLinear):
        return weight.rows(order)
    return weight[order].contiguous()
