"""Build a `Tokenizer` from GGUF metadata (gpt2-style byte-level BPE)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from slotserve.errors import ArtifactError
from slotserve.tokenizer import Tokenizer

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str, path: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, raw_bytes])
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, raw_bytes])
    raise ArtifactError(
        path,
        f"pre-tokenizer {pre!r} is not supported; supported: smollm, gpt-2, qwen2, llama-bpe",
        "tokenizer.ggml.pre",
    )


def tokenizer_from_gguf(meta: Mapping[str, Any], path: str) -> Tokenizer:
    """Byte-level BPE from ``tokenizer.ggml.*`` keys; special tokens come from token types."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ArtifactError(
            path,
            f"tokenizer model {kind!r} is not supported; expected 'gpt2'",
            "tokenizer.ggml.model",
        )
    tokens: list[str] = _required(meta, "tokenizer.ggml.tokens", list, path)
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ArtifactError(
            path, f"{len(types)} token types for {len(tokens)} tokens", "tokenizer.ggml.token_type"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = _merge_pairs(merges, path)
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad vocab/merges
        raise ArtifactError(
            path, f"inconsistent BPE vocabulary ({exc})", "tokenizer.ggml.merges"
        ) from exc
    backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")), path)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    return Tokenizer(
        backend,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=[int(i) for i in dict.fromkeys((eos, eot)) if i is not None],
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


def _merge_pairs(merges: list[str], path: str) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise ArtifactError(
                path, f"merge {merge!r} is not two space-separated tokens", "tokenizer.ggml.merges"
            )
        pairs.append((left, right))
    return pairs


def _required(meta: Mapping[str, Any], key: str, kind: type, path: str) -> Any:
    value = meta.get(key)
    if not isinstance(value, kind):
        raise ArtifactError(path, f"missing or not a {kind.__name__}", key)
    return value
