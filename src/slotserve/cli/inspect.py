"""``slotserve inspect``: a model's metadata, parameter count and bytes, as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser("inspect", help="print a model's metadata and size")
    parser.add_argument("model")


def run(args: argparse.Namespace) -> int:
    from slotserve.artifact import load

    model = load(args.model)
    info = model.info
    report = {
        "source": model.source,
        "name": info.name,
        "arch": info.arch,
        "layers": info.n_layers,
        "dim": info.dim,
        "heads": info.n_heads,
        "kv_heads": info.n_kv_heads,
        "head_dim": info.head_dim,
        "ffn_dim": info.ffn_dim,
        "vocab_size": info.vocab_size,
        "max_context": info.max_context,
        "rope": vars(info.rope),
        "sliding_window": list(info.sliding_window),
        "tied_embeddings": info.tied_embeddings,
        "bos_id": info.bos_id,
        "eos_ids": list(info.eos_ids),
        "parameters": model.weights.n_params if model.weights is not None else None,
        "weight_bytes": model.weight_bytes,
        "halves": model.halves.kind,
        "kernels": model.kernels.describe(),
        "kv_bytes_per_token_fp32": info.kv_bytes_per_token(4),
        "chat_template": model.tokenizer.chat_template is not None,
    }
    print(json.dumps(report, ensure_ascii=False))
    return 0
