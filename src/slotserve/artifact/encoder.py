"""Read a sentence-transformers model directory (the BERT family) into an `EncoderModel`.

The directory is what sentence-transformers saves: ``modules.json`` (a ``Transformer``, a
``Pooling`` and, when the embedding is normalised, a ``Normalize`` module),
``sentence_bert_config.json`` (``max_seq_length``, ``do_lower_case``), the pooling module's
``config.json`` (mean or CLS), and the transformer's Hugging Face files at the module's path
(``config.json`` of a ``bert`` model, ``model.safetensors``, ``tokenizer.json``: WordPiece).
A text longer than ``max_seq_length`` tokens (capped at the model's positions) is truncated
to it, special tokens included, as sentence-transformers truncates.

`load_encoder` marks what it holds in a memory ledger, as `slotserve.load` does for a
decoder: the process before its first model (``runtime``), the tokenizer, the weights
(their anonymous growth, at least their own bytes) and the load's peak.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from slotserve.artifact.named import model_path
from slotserve.errors import ArtifactError
from slotserve.memory import MemoryLedger, trim_heap
from slotserve.model.encoder import (
    ENCODER_WEIGHT_FORMATS,
    EncoderInfo,
    EncoderLayer,
    EncoderModel,
    EncoderPooling,
    EncoderWeightFormat,
    EncoderWeights,
    LayerNorm,
    with_encoder_weights,
)
from slotserve.model.layers import DenseLinear
from slotserve.native import build_kernels

TRANSFORMER = "sentence_transformers.models.Transformer"
POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"
ENCODER_FAMILIES = ("bert",)


def load_encoder(
    spec: str | Path,
    *,
    weights: EncoderWeightFormat = "fp32",
    ledger: MemoryLedger | None = None,
) -> EncoderModel:
    """Load the encoder of ``spec``: a named one (``minilm``) or a sentence-transformers
    directory. ``weights``: ``"fp32"`` as stored (embeddings equal sentence-transformers'),
    ``"q8_0"`` with every layer's projections in Q8_0 blocks on the compiled block kernel
    (a quarter of the bytes; close to, not equal to, sentence-transformers'). Its
    arenas go into ``ledger`` (a new one unless given; ``model.ledger`` either way)."""
    if weights not in ENCODER_WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not one of {ENCODER_WEIGHT_FORMATS}")
    if weights == "q8_0" and build_kernels().blocks is None:
        raise ValueError(
            "weights='q8_0' needs the block kernel, which is not built (see the warning "
            "above); load with weights='fp32'"
        )
    directory = model_path(spec)
    if not directory.is_dir():
        raise ArtifactError(
            directory, "not a directory; pass 'minilm' or a sentence-transformers model directory"
        )
    ledger = ledger if ledger is not None else MemoryLedger()
    trim_heap()
    meter = ledger.meter(f"load {spec}", peak="load")
    if not ledger.has("runtime"):
        ledger.add("runtime", meter.start.anonymous, "measured", "the process before a model")
    info, transformer_dir = read_encoder_info(directory)
    tokenizer = _read_tokenizer(transformer_dir)
    meter.mark("tokenizer")
    dense = _build_weights(info, _read_safetensors(transformer_dir), transformer_dir)
    model = EncoderModel(
        info, with_encoder_weights(dense, weights), tokenizer, str(directory), weights
    )
    del dense
    trim_heap()
    meter.mark("weights", at_least=model.weight_bytes)
    meter.close()
    model.ledger = ledger
    return model


def read_encoder_info(directory: Path) -> tuple[EncoderInfo, Path]:
    """The `EncoderInfo` of a sentence-transformers directory, and the directory of its
    transformer module (the Hugging Face files)."""
    modules = _read_json(directory / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ArtifactError(directory / "modules.json", "expected a JSON list of modules")
    kinds = {str(m.get("type")): directory / str(m.get("path", "")) for m in modules}
    for needed in (TRANSFORMER, POOLING):
        if needed not in kinds:
            raise ArtifactError(
                directory / "modules.json",
                f"no {needed} module (found {sorted(kinds)}); slotserve serves a "
                "transformer, its pooling and optionally Normalize",
            )
    unknown = sorted(set(kinds) - {TRANSFORMER, POOLING, NORMALIZE})
    if unknown:
        raise ArtifactError(
            directory / "modules.json",
            f"modules {unknown} are not supported; slotserve serves a transformer, its "
            "pooling and optionally Normalize",
        )
    transformer_dir = kinds[TRANSFORMER]
    config = _read_json_if_present(transformer_dir / "config.json", required=True)
    family = config.get("model_type")
    if family not in ENCODER_FAMILIES:
        raise ArtifactError(
            transformer_dir / "config.json",
            f"model_type {family!r} is not an encoder slotserve reads ({ENCODER_FAMILIES})",
            "model_type",
        )
    sbert = _read_json_if_present(directory / "sentence_bert_config.json")
    positions = int(config["max_position_embeddings"])
    max_seq_len = min(int(sbert.get("max_seq_length") or positions), positions)
    info = EncoderInfo(
        vocab_size=int(config["vocab_size"]),
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=int(config["num_attention_heads"]),
        ffn_dim=int(config["intermediate_size"]),
        max_positions=positions,
        norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        pooling=_pooling(kinds[POOLING] / "config.json"),
        normalize=NORMALIZE in kinds,
        max_seq_len=max_seq_len,
        lowercase=bool(sbert.get("do_lower_case", False)),
    )
    _check_activation(config, transformer_dir / "config.json")
    return info, transformer_dir


def _pooling(path: Path) -> EncoderPooling:
    config = _read_json_if_present(path, required=True)
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v is True)
    if modes == ["pooling_mode_mean_tokens"]:
        return "mean"
    if modes == ["pooling_mode_cls_token"]:
        return "cls"
    raise ArtifactError(
        path, f"pooling {modes} is not supported; slotserve pools by mean tokens or CLS token"
    )


def _check_activation(config: dict[str, Any], path: Path) -> None:
    if config.get("hidden_act", "gelu") != "gelu":
        raise ArtifactError(
            path,
            f"hidden_act {config['hidden_act']!r}: slotserve's encoder uses GELU",
            "hidden_act",
        )
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ArtifactError(
            path,
            f"position_embedding_type {config['position_embedding_type']!r}: slotserve's "
            "encoder reads absolute positions",
            "position_embedding_type",
        )


def _read_tokenizer(directory: Path) -> tokenizers.Tokenizer:
    path = directory / "tokenizer.json"
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises plain Exceptions for missing or bad files
        raise ArtifactError(path, f"cannot read the tokenizer ({exc})") from None


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ArtifactError(directory, "no *.safetensors weight files in the model directory")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise ArtifactError(file, f"cannot read the weights ({exc})") from None
    # Checkpoints saved from BertForX carry a "bert." prefix on the encoder's tensors.
    return {name.removeprefix("bert."): tensor for name, tensor in tensors.items()}


class _Tensors:
    """Checked access: a missing or misshapen tensor is an `ArtifactError` naming it."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: Path) -> None:
        self.tensors, self.source = tensors, source

    def get(self, name: str, *shape: int) -> torch.Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ArtifactError(self.source, f"tensor missing, expected shape {shape}", name)
        if tuple(tensor.shape) != shape:
            raise ArtifactError(
                self.source, f"tensor has shape {tuple(tensor.shape)}, expected {shape}", name
            )
        return tensor.float().contiguous()

    def norm(self, prefix: str, dim: int) -> LayerNorm:
        return LayerNorm(self.get(prefix + ".weight", dim), self.get(prefix + ".bias", dim))

    def linear(self, prefixes: list[str], rows: int, cols: int) -> DenseLinear:
        """The row-wise concatenation of the ``prefixes``' weights and biases."""
        weights = [self.get(p + ".weight", rows, cols) for p in prefixes]
        biases = [self.get(p + ".bias", rows) for p in prefixes]
        if len(prefixes) == 1:
            return DenseLinear(weights[0], biases[0])
        return DenseLinear(torch.cat(weights), torch.cat(biases))


def _build_weights(
    info: EncoderInfo, tensors: dict[str, torch.Tensor], source: Path
) -> EncoderWeights:
    sd, dim, ffn = _Tensors(tensors, source), info.dim, info.ffn_dim
    layers = []
    for i in range(info.n_layers):
        p = f"encoder.layer.{i}."
        attn = p + "attention."
        qkv = [attn + "self.query", attn + "self.key", attn + "self.value"]
        layers.append(
            EncoderLayer(
                qkv=sd.linear(qkv, dim, dim),
                o=sd.linear([attn + "output.dense"], dim, dim),
                attn_norm=sd.norm(attn + "output.LayerNorm", dim),
                up=sd.linear([p + "intermediate.dense"], ffn, dim),
                down=sd.linear([p + "output.dense"], dim, ffn),
                mlp_norm=sd.norm(p + "output.LayerNorm", dim),
            )
        )
    types_name = "embeddings.token_type_embeddings.weight"
    types = tensors.get(types_name)
    token_type = torch.zeros(dim) if types is None else sd.get(types_name, types.shape[0], dim)[0]
    return EncoderWeights(
        words=sd.get("embeddings.word_embeddings.weight", info.vocab_size, dim),
        positions=sd.get("embeddings.position_embeddings.weight", info.max_positions, dim),
        token_type=token_type,
        embed_norm=sd.norm("embeddings.LayerNorm", dim),
        layers=tuple(layers),
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(path, "file missing from the model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(path, f"not valid JSON ({exc})") from exc


def _read_json_if_present(path: Path, *, required: bool = False) -> dict[str, Any]:
    """A JSON object file's contents; ``{}`` for a missing file unless ``required``."""
    if not required and not path.is_file():
        return {}
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ArtifactError(path, f"expected a JSON object, got {type(value).__name__}")
    return value
