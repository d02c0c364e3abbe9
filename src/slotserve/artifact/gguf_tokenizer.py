"""Build a `Tokenizer` from GGUF metadata: gpt2-style byte-level BPE (HF `tokenizers`), or a
"llama" SentencePiece vocabulary (`slotserve.tokenizer.spm`, llama.cpp's algorithm).

For "llama" the GGUF token types become llama.cpp's token attributes here, with the
overrides llama.cpp's loader applies by token text (``llama_vocab::impl::load``): the
end-of-generation, end-of-turn and fill-in-the-middle markers it recognises are control
tokens even where the file types them otherwise (Gemma 3's ``</s>`` is user-defined in the
file, control in llama.cpp: a prompt's ``</s>`` is one token, and decoding hides it).

Token texts that are not UTF-8 (`read_metadata` passes ``tokenizer.ggml.tokens`` on as the
file has it) are decided here, by what each kind does with a text. llama.cpp keeps token
texts as bytes and loads such a vocabulary. A "llama" (SentencePiece) token is kept: its
text is held losslessly as surrogate escapes (``bytes.decode("utf-8", "surrogateescape")``),
so `SpmVocab.piece` gives back the file's very bytes, as llama.cpp's ``token_to_piece`` does,
and, as in llama.cpp, the encoder never produces it (it merges whole characters of valid
text, and the server refuses text with lone surrogates). A "gpt2" token is refused, naming
the key and its index: byte-level BPE texts are printable Unicode by construction (every
byte has its own character), so raw bytes there are a corrupt file, and the BPE backend
(Hugging Face ``tokenizers``) holds Unicode texts only. No converter of llama.cpp's writes
such texts (SentencePiece pieces are Unicode; its GGML converter writes byte tokens as
``<0xXX>``), so the kept case is for hand-made files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from slotserve.artifact.gguf_reader import utf8_error
from slotserve.errors import ArtifactError
from slotserve.tokenizer import Tokenizer, spm

TOKENS_KEY = "tokenizer.ggml.tokens"
TEMPLATE_KEY = "tokenizer.chat_template"
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
    """The tokenizer ``tokenizer.ggml.*`` describes; special tokens come from token types."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece(meta, path)
    if kind != "gpt2":
        raise ArtifactError(
            path,
            f"tokenizer model {kind!r} is not supported; expected 'gpt2' or 'llama'",
            "tokenizer.ggml.model",
        )
    tokens, types = _tokens_and_types(meta, path, keep_bytes=False)
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
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
        chat_template=meta.get(TEMPLATE_KEY),
        chat_template_source=f"{path} [{TEMPLATE_KEY}]",
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


# llama.cpp's llama_token_type -> llama_token_attr (1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte; anything else undefined).
_ATTRS = {
    1: spm.ATTR_NORMAL,
    2: spm.ATTR_UNKNOWN,
    3: spm.ATTR_CONTROL,
    4: spm.ATTR_USER_DEFINED,
    5: spm.ATTR_UNUSED,
    6: spm.ATTR_BYTE,
}
# Texts llama.cpp's loader makes control tokens whatever their type: its end-of-turn,
# end-of-message and fill-in-the-middle markers, and its end-of-generation list.
_CONTROL_TEXTS = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
        "<end_of_utterance>", "<|eom_id|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "</s>", "[EOS]", "<eos>", "<turn|>", "<|tool_response>", "[e~[",
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
        "▁<PRE>", "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>",
        "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>",
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
        "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
        "<|file_sep|>",
    )
)  # fmt: skip
# llama.cpp's end-of-turn texts: where the file names no tokenizer.ggml.eot_token_id, the
# token with one of these texts is its EOT, which ends generation beside EOS (llama.cpp
# takes whichever its hash map meets first; a vocabulary rarely has two of them).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip


def _sentencepiece(meta: Mapping[str, Any], path: str) -> Tokenizer:
    """A "llama" vocabulary as llama.cpp reads it: scores, types as attributes (with its
    text overrides), ``add_space_prefix`` and ``add_bos_token`` defaulting to true."""
    tokens, types = _tokens_and_types(meta, path, keep_bytes=True)
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) < len(tokens):
        raise ArtifactError(
            path, f"{len(scores)} scores for {len(tokens)} tokens", "tokenizer.ggml.scores"
        )
    attrs = [_ATTRS.get(int(kind), 0) for kind in types]
    for index, text in enumerate(tokens):
        if text in _CONTROL_TEXTS:
            attrs[index] |= spm.ATTR_CONTROL
    vocab = spm.SpmVocab(
        tokens,
        scores[: len(tokens)],
        attrs,
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is None:
        eot = next(
            (vocab.token_to_id(t) for t in _EOT_TEXTS if vocab.token_to_id(t) is not None), None
        )
    return Tokenizer(
        vocab,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=[int(i) for i in dict.fromkeys((eos, eot)) if i is not None],
        chat_template=meta.get(TEMPLATE_KEY),
        chat_template_source=f"{path} [{TEMPLATE_KEY}]",
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
    )


def _tokens_and_types(
    meta: Mapping[str, Any], path: str, *, keep_bytes: bool
) -> tuple[list[str], list[int]]:
    """The token texts (those that are not UTF-8 kept as surrogate escapes with
    ``keep_bytes``, else refused: see the module's docstring) and their types."""
    texts: list[str | bytes] = _required(meta, TOKENS_KEY, list, path)
    tokens = [_token_text(text, index, path, keep_bytes) for index, text in enumerate(texts)]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ArtifactError(
            path, f"{len(types)} token types for {len(tokens)} tokens", "tokenizer.ggml.token_type"
        )
    return tokens, types


def _token_text(text: str | bytes, index: int, path: str, keep_bytes: bool) -> str:
    if isinstance(text, str):
        return text
    if keep_bytes:
        return text.decode("utf-8", "surrogateescape")
    raise ArtifactError(
        path,
        f"token {index} is not UTF-8 text ({utf8_error(text)}); a byte-level BPE vocabulary's "
        "texts are Unicode characters, so the file is corrupt",
        TOKENS_KEY,
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
