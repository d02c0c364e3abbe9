"""Tokenizer (HF `tokenizers`), chat templates (jinja2) and streaming detokenisation.

A `Tokenizer` is built from a Hugging Face ``tokenizer.json`` or from GGUF metadata
(see `artifact.gguf_tokenizer`); either way encoding runs in the Rust `tokenizers` library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        chat_template: str | None,
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._special_ids = frozenset(
            index for index, token in backend.get_added_tokens_decoder().items() if token.special
        )

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer, as one JSON string."""
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "bos_id": self.bos_id,
                "eos_ids": list(self.eos_ids),
                "chat_template": self.chat_template,
                "add_bos": self.add_bos,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        fields = json.loads(text)
        backend = tokenizers.Tokenizer.from_str(fields.pop("backend"))
        return cls(backend, **fields)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return int(found) if found is not None else None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) are
        parsed as such. A BOS is prepended when ``add_bos`` (default: the model's rule)."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's chat template (as transformers does)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        template = _jinja_env().from_string(self.chat_template)
        bos = self.decode([self.bos_id]) if self.bos_id is not None else ""
        eos = self.decode([self.eos_ids[0]]) if self.eos_ids else ""
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
        )

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _jinja_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    return env


class StreamDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a multi-byte character; such a token
    decodes to U+FFFD. The delta is held back until a later token completes it. Decoding a
    short window (``prefix..end``) rather than the whole sequence keeps it O(1) per token
    and lets tokenizers that merge spaces across tokens decode correctly.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self._prefix : self._read], skip_special=self.skip_special)
        full_text = decode(self.ids[self._prefix :], skip_special=self.skip_special)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character decodes as U+FFFD)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self._prefix : self._read], skip_special=self.skip_special)
        full_text = decode(self.ids[self._prefix :], skip_special=self.skip_special)
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :]
