"""`ModelInfo` from a Hugging Face ``config.json`` (Llama, SmolLM, Mistral, Qwen2/2.5, Qwen3).

Accepts both the transformers 4.x keys (``rope_theta``, ``rope_scaling``) and the 5.x
``rope_parameters`` dict, and per-layer attention kinds from ``layer_types``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo, RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _required_int(config: dict[str, Any], key: str, path: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArtifactError(path, f"missing or not an integer (got {value!r})", key)
    return value


def model_info_from_config(config: dict[str, Any], path: Path) -> ModelInfo:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ArtifactError(
            path,
            f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}",
            "model_type",
        )
    n_layers = _required_int(config, "num_hidden_layers", path)
    dim = _required_int(config, "hidden_size", path)
    n_heads = _required_int(config, "num_attention_heads", path)
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return ModelInfo(
        arch=str(model_type),
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or dim // n_heads,
        ffn_dim=_required_int(config, "intermediate_size", path),
        vocab_size=_required_int(config, "vocab_size", path),
        max_context=config.get("max_position_embeddings") or 2048,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope(config, path),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_windows(config, model_type, n_layers, path),
        bos_id=config.get("bos_token_id"),
        eos_ids=eos_ids,
        name=str(config.get("_name_or_path") or path.parent.name),
    )


def _rope(config: dict[str, Any], path: Path) -> RopeConfig:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta)
    if kind == "linear":
        return RopeConfig(theta, "linear", float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta,
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ArtifactError(
        path,
        f"rope type {kind!r} is not supported; supported: default, linear, llama3",
        "rope_scaling",
    )


def _sliding_windows(
    config: dict[str, Any], model_type: str, n_layers: int, path: Path
) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise ArtifactError(
                path, f"{len(layer_types)} layer types for {n_layers} layers", "layer_types"
            )
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window") or not window:
            return ()
        first = int(config.get("max_window_layers", n_layers))
        return tuple(window if i >= first else None for i in range(n_layers))
    return (window,) * n_layers if window else ()
