"""Read a GGUF file with gguf-py: metadata, `ModelInfo`, and dequantised tensors.

Every way a file can be wrong (bad magic, truncated tensor data, missing keys, unknown
quantisation or architecture) becomes an `ArtifactError` naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo, RopeConfig

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")

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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _CheckedReader(GGUFReader):
    """gguf-py's reader, but a tensor whose data lies past the end of the file (or has an
    unknown type) is reported by name before numpy fails to reshape it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                raise ArtifactError(
                    self.path, f"unknown ggml tensor type {int(raw_dtype[0])}", name
                ) from None
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise ArtifactError(
                    self.path,
                    f"tensor data ends at byte {end} but the file has {size} bytes "
                    "(truncated file?)",
                    name,
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    """Open ``path`` after checking the magic and that every tensor lies inside the file."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ArtifactError(path, f"cannot read the file ({exc.strerror})") from exc
    if magic != b"GGUF":
        raise ArtifactError(path, f"not a GGUF file: magic is {magic!r}, expected b'GGUF'", "magic")
    try:
        return _CheckedReader(path)
    except ArtifactError:
        raise
    except Exception as exc:  # gguf-py raises ValueError/struct/numpy errors on bad headers
        raise ArtifactError(path, f"corrupt or truncated GGUF header ({exc})", "header") from exc


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1:
            if field.types[1] == GGUFValueType.STRING:
                meta[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                meta[key] = [field.parts[i].item() for i in field.data]
        else:
            meta[key] = field.contents()
    return meta


def _meta(meta: dict[str, Any], key: str, path: Path, kind: type = int) -> Any:
    value = meta.get(key)
    if value is None or not isinstance(value, (int, float) if kind is float else kind):
        raise ArtifactError(path, f"missing or not a {kind.__name__}", key)
    return value


def model_info_from_gguf(meta: dict[str, Any], tensor_names: set[str], path: Path) -> ModelInfo:
    """`ModelInfo` from ``{arch}.*`` keys (tied embeddings: no ``output.weight`` tensor)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ArtifactError(
            path,
            f"architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}",
            "general.architecture",
        )
    n_layers = _meta(meta, f"{arch}.block_count", path)
    n_heads = _meta(meta, f"{arch}.attention.head_count", path)
    dim = _meta(meta, f"{arch}.embedding_length", path)
    head_dim = meta.get(f"{arch}.attention.key_length") or dim // n_heads
    window = meta.get(f"{arch}.attention.sliding_window")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return ModelInfo(
        arch=str(arch),
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or n_heads,
        head_dim=head_dim,
        ffn_dim=_meta(meta, f"{arch}.feed_forward_length", path),
        vocab_size=meta.get(f"{arch}.vocab_size") or len(tokens),
        max_context=_meta(meta, f"{arch}.context_length", path),
        norm_eps=float(_meta(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, float)),
        rope=_rope_from_gguf(meta, arch),
        tied_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        sliding_window=(window,) * n_layers if window else (),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=(eos,) if eos is not None else (),
        name=str(meta.get("general.name", path.stem)),
    )


def _rope_from_gguf(meta: dict[str, Any], arch: str) -> RopeConfig:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return RopeConfig(theta, "linear", float(meta[f"{arch}.rope.scaling.factor"]))
    return RopeConfig(theta)


def hf_tensor_name(name: str, path: Path) -> str:
    """Map a GGUF tensor name to its Hugging Face name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ArtifactError(path, "unexpected tensor name for a Llama-family model", name)


def iter_tensors(
    reader: GGUFReader, info: ModelInfo, path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, fp32 tensor)`` for every tensor, dequantised and un-permuted."""
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_QUANTS:
            raise ArtifactError(
                path,
                f"tensor type {kind} is not supported; supported: {SUPPORTED_QUANTS}",
                tensor.name,
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))
        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            array = array.reshape(shape)
        except (ValueError, NotImplementedError) as exc:
            raise ArtifactError(
                path, f"cannot dequantise {kind} data ({exc})", tensor.name
            ) from exc
        name = hf_tensor_name(tensor.name, path)
        yield name, _unpermute(name, torch.from_numpy(array.copy()), info)


def _unpermute(name: str, weight: torch.Tensor, info: ModelInfo) -> torch.Tensor:
    # llama.cpp's converter interleaves the two rotary halves of each Q/K head for the
    # "llama" architecture (GGML's rope pairs adjacent dims). Undo it so the model can use
    # the rotate-half layout of the Hugging Face weights for every source.
    if info.arch != "llama":
        return weight
    if name.endswith("self_attn.q_proj.weight"):
        heads = info.n_heads
    elif name.endswith("self_attn.k_proj.weight"):
        heads = info.n_kv_heads
    else:
        return weight
    rows, cols = weight.shape
    return weight.reshape(heads, info.head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
