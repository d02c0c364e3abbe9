"""Fixtures of the encoder tests: all-MiniLM-L6-v2 as slotserve loads it and as
sentence-transformers loads it (the reference), and a tiny random encoder for the engine's
state machine (MiniLM's tokenizer, random weights: a step takes microseconds)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import tokenizers
import torch
from sentence_transformers import SentenceTransformer

from slotserve.artifact.encoder import load_encoder
from slotserve.artifact.minilm import minilm_dir
from slotserve.model.encoder import (
    EncoderInfo,
    EncoderLayer,
    EncoderModel,
    EncoderWeights,
    LayerNorm,
)
from slotserve.model.layers import DenseLinear


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def minilm(minilm_path: Path) -> EncoderModel:
    return load_encoder("minilm")


@pytest.fixture(scope="session")
def reference(minilm_path: Path) -> SentenceTransformer:
    """sentence-transformers' own load of the same directory, on the CPU."""
    return SentenceTransformer(str(minilm_path), device="cpu")


def _linear(generator: torch.Generator, rows: int, cols: int) -> DenseLinear:
    weight = torch.randn(rows, cols, generator=generator) / cols**0.5
    return DenseLinear(weight, torch.randn(rows, generator=generator) * 0.1)


def _norm(generator: torch.Generator, dim: int) -> LayerNorm:
    return LayerNorm(1 + 0.1 * torch.randn(dim, generator=generator), torch.zeros(dim))


@functools.cache
def tiny_encoder(max_seq_len: int = 24) -> EncoderModel:
    """A 2-layer encoder of width 32 with random weights and MiniLM's WordPiece tokenizer."""
    info = EncoderInfo(
        vocab_size=30522,
        dim=32,
        n_layers=2,
        n_heads=4,
        ffn_dim=64,
        max_positions=64,
        norm_eps=1e-12,
        pooling="mean",
        normalize=True,
        max_seq_len=max_seq_len,
    )
    g = torch.Generator().manual_seed(49)
    layers = tuple(
        EncoderLayer(
            qkv=_linear(g, 3 * info.dim, info.dim),
            o=_linear(g, info.dim, info.dim),
            attn_norm=_norm(g, info.dim),
            up=_linear(g, info.ffn_dim, info.dim),
            down=_linear(g, info.dim, info.ffn_dim),
            mlp_norm=_norm(g, info.dim),
        )
        for _ in range(info.n_layers)
    )
    weights = EncoderWeights(
        words=torch.randn(info.vocab_size, info.dim, generator=g),
        positions=torch.randn(info.max_positions, info.dim, generator=g) * 0.1,
        token_type=torch.zeros(info.dim),
        embed_norm=_norm(g, info.dim),
        layers=layers,
    )
    tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    return EncoderModel(info, weights, tokenizer, "tiny random encoder")
