"""Load a Hugging Face model directory: ``config.json``, ``*.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` (for the chat template and BOS rule)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from slotserve.artifact.hf_config import model_info_from_config
from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo
from slotserve.model import Model, build_weights
from slotserve.native import NO_KERNELS, Kernels
from slotserve.tokenizer import Tokenizer


def load_hf_dir(
    path: Path,
    kernels: Kernels = NO_KERNELS,
    tokenizer_read: Callable[[], object] | None = None,
) -> Model:
    """The model in Hugging Face directory ``path``; ``tokenizer_read`` is called once its
    tokenizer is built, before its weights are read (`slotserve.load` marks the
    tokenizer's arena there)."""
    config = _read_json(path / "config.json")
    info = model_info_from_config(config, path / "config.json")
    tokenizer = _read_tokenizer(path, info)
    if tokenizer_read is not None:
        tokenizer_read()
    tensors = _read_safetensors(path)
    weights = build_weights(info, tensors, str(path))
    return Model.from_weights(info, tokenizer, weights, str(path), kernels)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(path, "file missing from the model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(path, f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ArtifactError(path, f"expected a JSON object, got {type(value).__name__}")
    return value


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ArtifactError(path, "no *.safetensors weight files in the model directory")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(file, f"corrupt or truncated safetensors file ({exc})") from exc
    return tensors


def _read_tokenizer(path: Path, info: ModelInfo) -> Tokenizer:
    file = path / "tokenizer.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on every parse error
        raise ArtifactError(file, f"cannot read tokenizer ({exc})") from exc
    config = (
        _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer_config.json").exists()
        else {}
    )
    eos_ids = list(info.eos_ids)
    eos_token = _token_text(config.get("eos_token"))
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        eos_ids = list(dict.fromkeys([*eos_ids, eos_id]))
    bos_token = _token_text(config.get("bos_token"))
    bos_id = backend.token_to_id(bos_token) if bos_token is not None else info.bos_id
    template, source = _chat_template(path, config)
    return Tokenizer(
        backend,
        bos_id=bos_id,
        eos_ids=eos_ids,
        chat_template=template,
        add_bos=bool(config.get("add_bos_token", False)),
        chat_template_source=source,
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """The directory's chat template and where it was read (for `ChatTemplateInvalid`)."""
    template = config.get("chat_template")
    source = f"{path / 'tokenizer_config.json'} [chat_template]"
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        file = path / "chat_template.jinja"
        try:
            template, source = file.read_text(encoding="utf-8"), str(file)
        except (OSError, UnicodeDecodeError) as exc:
            raise ArtifactError(file, f"cannot read the chat template ({exc})") from exc
    return (template if isinstance(template, str) else None), source
