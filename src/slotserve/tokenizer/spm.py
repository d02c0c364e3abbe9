"""llama.cpp's SentencePiece tokenizer (GGUF ``tokenizer.ggml.model = "llama"``), token for
token as ``llama-vocab.cpp`` runs it (``llm_tokenizer_spm`` under ``tokenize`` and
``detokenize``, llama.cpp 0.3.36).

Encoding, as llama.cpp does:

1. Special-token partition (``tokenizer_st_partition``): every control, user-defined and
   unknown token, longest text first, splits the text fragments it occurs in; it becomes
   that token. ``parse_special=False`` skips control and unknown tokens (user-defined ones
   still split).
2. Each remaining fragment gets a leading space when ``add_space_prefix`` and it follows a
   special token (or starts the text); spaces become ``▁``.
3. The fragment's characters are merged pairwise, the pair whose joined text is the
   highest-scoring token first (ties: the leftmost), until no adjacent pair is a token.
   A symbol that is no token is written as its UTF-8 bytes (``<0xXX>`` tokens).

The merge of step 3 never crosses a point where two adjacent characters occur together in
no token (every symbol is a token or one character), so a fragment is cut there into words
(before a ``▁`` run, unless a token joins the preceding character to ``▁``) that merge on
their own; each word's ids are cached. The result is the same as merging the whole
fragment; it is only faster.

Decoding is llama.cpp's ``token_to_piece``: normal tokens with ``▁`` as a space, byte tokens
as their byte, user-defined tokens as written, control and unknown tokens as written or
(``skip_special``) not at all, unused ones as nothing; the bytes are joined, then read as
UTF-8. With ``add_space_prefix`` the first token loses one leading space.

This module owns the vocabulary and the algorithm; it knows nothing of GGUF (token types
become attributes in `slotserve.artifact.gguf_tokenizer`) nor of chat templates.
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# llama.cpp's llama_token_attr bits.
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

SPACE = "\u2581"  # ▁, SentencePiece's escaped space
_HIDDEN = ATTR_CONTROL | ATTR_UNKNOWN  # what skip_special leaves out
_PARTITIONED = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
# A token text that is not UTF-8 in the file is held as surrogate escapes (see
# slotserve.artifact.gguf_tokenizer); its piece is the file's bytes again.
_RAW = "surrogateescape"
_WORD_CACHE_ENTRIES = 1 << 16
_CACHED_WORD_CHARS = 64

Fragment = str | int  # text still to encode, or a special token's id


class SpmVocab:
    """A GGUF "llama" vocabulary: token texts, scores and llama.cpp attributes (`ATTR_*`).

    Immutable after construction except for its word cache; safe to use from several
    threads at once (the cache is a dict written whole entries at a time)."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        attrs: Sequence[int],
        *,
        add_space_prefix: bool,
    ) -> None:
        if not len(tokens) == len(scores) == len(attrs):
            raise ValueError(
                f"{len(tokens)} tokens, {len(scores)} scores and {len(attrs)} attributes; "
                "each token needs one of each"
            )
        # llama.cpp names an empty token "[EMPTY_<id>]"; a later duplicate text wins.
        self.tokens = [text or f"[EMPTY_{index}]" for index, text in enumerate(tokens)]
        self.scores = [float(score) for score in scores]
        self.attrs = [int(attr) for attr in attrs]
        self.add_space_prefix = add_space_prefix
        self._ids = {text: index for index, text in enumerate(self.tokens)}
        self._byte_ids = [self._byte_token(byte) for byte in range(256)]
        self.special_ids = frozenset(i for i, a in enumerate(self.attrs) if a & _HIDDEN)
        self._init_partition()
        self._word_cut = _word_cut_pattern(self.tokens)
        self._words: dict[str, tuple[int, ...]] = {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "scores": self.scores,
            "attrs": self.attrs,
            "add_space_prefix": self.add_space_prefix,
        }

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> SpmVocab:
        return cls(
            fields["tokens"],
            fields["scores"],
            fields["attrs"],
            add_space_prefix=bool(fields["add_space_prefix"]),
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._ids.get(text)

    @property
    def special_text_ids(self) -> dict[str, int]:
        """The text of each token `decode` hides with ``skip_special`` (control, unknown)."""
        return {self.tokens[index]: index for index in self.special_ids}

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS), as llama.cpp's ``tokenize`` without
        ``add_special``."""
        ids: list[int] = []
        after_special = True
        for fragment in self.partition(text, parse_special=parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                fragment = " " + fragment
            ids.extend(self._encode_fragment(fragment.replace(" ", SPACE)))
            after_special = False
        return ids

    def partition(self, text: str, *, parse_special: bool = True) -> list[Fragment]:
        """``text`` split into plain-text fragments and special-token ids
        (``tokenizer_st_partition``): each special token, longest first, splits every text
        fragment at each of its occurrences, left to right; empty fragments are dropped."""
        fragments: list[Fragment] = [text] if text else []
        for token_id in self._specials_in(text, parse_special):
            special = self.tokens[token_id]
            split: list[Fragment] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    split.append(fragment)
                    continue
                for index, part in enumerate(fragment.split(special)):
                    if index:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _init_partition(self) -> None:
        """The partition's special tokens in llama.cpp's order (longest UTF-8 text first;
        equal lengths by id: llama.cpp's sort is unstable there, which matters only for two
        equal-length tokens that overlap in a text), and an index to find which occur in a
        text: the lengths to try at each two-character start."""
        specials = [i for i, attr in enumerate(self.attrs) if attr & _PARTITIONED]
        specials.sort(key=lambda i: (-len(self.tokens[i].encode("utf-8", _RAW)), i))
        self._partition_order = {token_id: rank for rank, token_id in enumerate(specials)}
        self._special_ids = {self.tokens[i]: i for i in specials}
        lengths: defaultdict[str, set[int]] = defaultdict(set)
        for text in self._special_ids:
            lengths[text[:2]].add(len(text))
        self._special_lengths = {start: sorted(found) for start, found in lengths.items()}
        firsts = sorted({text[0] for text in self._special_ids})
        self._special_start = re.compile("[" + "".join(map(re.escape, firsts)) + "]")

    def _specials_in(self, text: str, parse_special: bool) -> list[int]:
        """The partition's special tokens that occur in ``text``, in partition order (a
        token that occurs nowhere in the text splits nothing, so leaving it out changes
        nothing)."""
        if not self._special_ids:
            return []
        found: set[int] = set()
        special_ids, special_lengths = self._special_ids, self._special_lengths
        for match in self._special_start.finditer(text):
            start = match.start()
            for size in (1, 2):
                for length in special_lengths.get(text[start : start + size], ()):
                    token_id = special_ids.get(text[start : start + length])
                    if token_id is not None:
                        found.add(token_id)
        if not parse_special:
            found = {i for i in found if not self.attrs[i] & _HIDDEN}
        return sorted(found, key=self._partition_order.__getitem__)

    def _encode_fragment(self, escaped: str) -> list[int]:
        ids: list[int] = []
        words = self._words
        for word in self._word_cut.split(escaped):
            cached = words.get(word)
            if cached is None:
                cached = tuple(self._merge(word))
                if len(word) <= _CACHED_WORD_CHARS:
                    if len(words) >= _WORD_CACHE_ENTRIES:
                        words.clear()
                    words[word] = cached
            ids.extend(cached)
        return ids

    def _merge(self, word: str) -> list[int]:
        """``llm_tokenizer_spm_session::tokenize`` on one word: symbols are characters,
        merged best bigram first, then each written as its token or its bytes."""
        ids, scores = self._ids, self.scores
        count = len(word)
        size = [1] * count  # each symbol's length in characters; 0 once merged away
        after = [*range(1, count), -1]
        before = list(range(-1, count - 1))
        # (-score, left, right, joined length): the heap pops the best score, then leftmost.
        queue: list[tuple[float, int, int, int]] = []
        for left in range(count - 1):
            token_id = ids.get(word[left : left + 2])
            if token_id is not None:
                queue.append((-scores[token_id], left, left + 1, 2))
        heapq.heapify(queue)
        while queue:
            _, left, right, joined = heapq.heappop(queue)
            if not size[left] or not size[right] or size[left] + size[right] != joined:
                continue  # one of the two was merged since this pair was queued
            size[left] = joined
            size[right] = 0
            after[left] = nxt = after[right]
            if nxt >= 0:
                before[nxt] = left
            for pair_left, pair_right in ((before[left], left), (left, nxt)):
                if pair_left < 0 or pair_right < 0:
                    continue
                end = pair_right + size[pair_right]
                token_id = ids.get(word[pair_left:end])
                if token_id is not None:
                    heapq.heappush(
                        queue, (-scores[token_id], pair_left, pair_right, end - pair_left)
                    )
        out: list[int] = []
        index = 0
        while index >= 0:
            symbol = word[index : index + size[index]]
            token_id = ids.get(symbol)
            if token_id is not None:
                out.append(token_id)
            else:
                out.extend(self._bytes_of(symbol))
            index = after[index]
        return out

    def _bytes_of(self, symbol: str) -> list[int]:
        out = []
        for byte in symbol.encode("utf-8", "surrogatepass"):
            token_id = self._byte_ids[byte]
            if token_id is None:
                raise ValueError(
                    f"cannot encode {symbol!r}: the vocabulary has no token for byte "
                    f"0x{byte:02X} (<0x{byte:02X}>)"
                )
            out.append(token_id)
        return out

    def _byte_token(self, byte: int) -> int | None:
        """``byte_to_token``: ``<0xXX>``, else the byte itself as a one-character token."""
        found = self._ids.get(f"<0x{byte:02X}>")
        return found if found is not None or byte >= 0x80 else self._ids.get(chr(byte))

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids`` (llama.cpp's ``detokenize``); incomplete UTF-8 reads as U+FFFD.
        Ids outside the vocabulary decode to nothing."""
        pieces = [self.piece(token_id, skip_special=skip_special) for token_id in ids]
        if self.add_space_prefix and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", "replace")

    def piece(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The bytes one token stands for (``token_to_piece``)."""
        if not 0 <= token_id < len(self.tokens):
            return b""
        attr, text = self.attrs[token_id], self.tokens[token_id]
        if attr & _HIDDEN and skip_special:
            return b""
        if attr & _PARTITIONED:
            return text.encode("utf-8", _RAW)
        if attr & ATTR_NORMAL:
            return text.replace(SPACE, " ").encode("utf-8", _RAW)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused or undefined


def _word_cut_pattern(tokens: Sequence[str]) -> re.Pattern[str]:
    """Where an escaped fragment may be cut into words that merge alone: before a ``▁``
    that follows a character which no token joins to ``▁`` (nor another ``▁``)."""
    # Searched in all texts at once; the separator only ever adds itself (a stricter cut).
    joined = set(re.findall(f"([^{SPACE}]){SPACE}", "\0".join(tokens)))
    allowed = "".join(map(re.escape, sorted(joined | {SPACE})))
    return re.compile(f"(?<=[^{allowed}])(?={SPACE})")
