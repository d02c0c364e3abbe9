"""``slotserve bench embeddings``: texts per second of an encoder (default all-MiniLM-L6-v2)
through `EncoderEngine`, beside sentence-transformers' ``encode`` on the same texts, the
same batch size and the same torch threads, one timed run each (after one warm-up batch
each), with the largest difference between their embeddings.

The passages are synthetic and deterministic: sentences of a fixed vocabulary, of lengths
spread from a few tokens to past the model's limit, so truncation and padding both count.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import torch

from slotserve.artifact.encoder import load_encoder
from slotserve.engine.encoder import EncoderEngine
from slotserve.engine.encoder_plan import EncoderConfig
from slotserve.model.encoder import EncoderWeightFormat

WORDS = (
    *("device", "memory", "budget", "request", "model", "embedding", "passage", "retrieval"),
    *("index", "note", "kernel", "scheduler", "battery", "thermal", "offline", "search"),
    *("query", "answer", "document", "sentence", "token"),
)


def passages(n: int, seed: int = 49) -> list[str]:
    """``n`` passages of 3 to 320 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 320))) for _ in range(n)]


def run_embeddings(
    spec: str = "minilm",
    *,
    n_texts: int = 512,
    batch: int = 32,
    weights: str = "auto",
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """One timed run of slotserve and of sentence-transformers on ``n_texts`` passages
    (`passages`), or on ``texts`` where given; ``weights`` as ``slotserve bench --weights``
    says it: ``gguf`` holds the projections as Q8_0 blocks on the block kernel, anything
    else fp32."""
    fmt: EncoderWeightFormat = "q8_0" if weights == "gguf" else "fp32"
    texts = passages(n_texts) if texts is None else texts
    n_texts = len(texts)
    model = load_encoder(spec, weights=fmt)
    config = EncoderConfig(max_texts=n_texts, max_batch_texts=batch)
    with EncoderEngine(model, config) as engine:
        engine.embed(texts[:batch])  # warm-up
        began = time.perf_counter()
        ours = engine.embed(texts)
        ours_s = time.perf_counter() - began
    result: dict[str, Any] = {
        "model": spec,
        "weights": fmt,
        "texts": n_texts,
        "batch": batch,
        "tokens": sum(len(ids) for ids in model.tokenize(texts)),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "slotserve_texts_per_s": n_texts / ours_s,
    }
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        result["sentence_transformers"] = "not installed: pip install sentence-transformers"
        return result
    reference = SentenceTransformer(model.source, device="cpu")
    reference.encode(texts[:batch], batch_size=batch)  # warm-up
    began = time.perf_counter()
    theirs = reference.encode(texts, batch_size=batch, convert_to_tensor=True)
    theirs_s = time.perf_counter() - began
    result["sentence_transformers_texts_per_s"] = n_texts / theirs_s
    result["ratio"] = theirs_s / ours_s
    result["max_abs_diff"] = float((ours - theirs).abs().max())
    return result


def report(result: dict[str, Any], markdown: bool) -> str:
    if not markdown:
        return json.dumps(result, indent=2)
    ours = result["slotserve_texts_per_s"]
    rows = [f"| slotserve EncoderEngine ({result['weights']}) | {ours:.1f} |"]
    if "sentence_transformers_texts_per_s" in result:
        rows.append(
            f"| sentence-transformers encode | {result['sentence_transformers_texts_per_s']:.1f} |"
        )
    head = (
        f"{result['texts']} passages ({result['tokens']} tokens after truncation), batch "
        f"{result['batch']}, {result['torch_threads']} torch threads"
    )
    tail = (
        f"\nratio {result.get('ratio', float('nan')):.2f}x, max |diff| {result.get('max_abs_diff')}"
    )
    return "\n".join([head, "", "| runtime | texts/s |", "|---|---|", *rows]) + tail
