"""Tokenizer, chat templates (jinja2) and streaming detokenisation.

A `Tokenizer` is built from a Hugging Face ``tokenizer.json`` or from GGUF metadata (see
`artifact.gguf_tokenizer`). Its backend is either the Rust `tokenizers` library (HF files,
GGUF "gpt2" byte-level BPE) or `spm.SpmVocab` (GGUF "llama" SentencePiece vocabularies,
encoded exactly as llama.cpp does, which `tokenizers` cannot express: its BPE needs
merges and its Unigram is Viterbi, not llama.cpp's greedy score-ordered merges). Both sit
behind the `TokenCodec` seam; everything above it (BOS rule, chat, streaming) is shared.

A chat template is compiled once, when it is set (at load, or by ``serve --chat-template``),
not per request. A template that does not parse (a Jinja syntax error) does not stop the
model from loading: the model keeps serving plain prompts, and every chat rendering raises
`ChatTemplateInvalid`, a `ChatTemplateMissing` that names where the template came from, the
line and jinja2's message; the server answers it as it answers a model with no template (400
``chat_template_missing``), never 500. Refusing the load instead would take the model's
completions away, and with them the fix: ``--chat-template FILE`` replaces the template only
after the model has loaded.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jinja2
import jinja2.sandbox
import tokenizers

from slotserve.tokenizer.spm import SpmVocab

Backend = tokenizers.Tokenizer | SpmVocab

log = logging.getLogger("slotserve")

# Where a template set without a named source came from, in `ChatTemplateInvalid`'s message.
SET_TEMPLATE_SOURCE = "chat template"


class ChatTemplateMissing(ValueError):
    """Chat messages were given to a model that has no chat template."""

    def __init__(self) -> None:
        super().__init__(
            "this model has no chat template (no tokenizer.chat_template in its GGUF, no "
            "chat_template in its tokenizer_config.json); give one with --chat-template FILE "
            "(a Jinja chat template), or send a plain prompt instead of chat messages"
        )


class ChatTemplateInvalid(ChatTemplateMissing):
    """The model's chat template does not parse, so the model takes no chat messages (as one
    without a template takes none): ``source`` names the file (and metadata key) it came
    from, ``line`` and ``reason`` are jinja2's (``line`` None where jinja2 gives none)."""

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        self.source, self.line, self.reason = source, line, reason
        where = f"line {line}: " if line is not None else ""
        ValueError.__init__(
            self,
            f"{source}: the chat template does not parse ({where}{reason}), so this model "
            "takes no chat messages; give a working one with --chat-template FILE (a Jinja "
            "chat template), or send a plain prompt instead of chat messages",
        )

    def again(self) -> ChatTemplateInvalid:
        """A fresh copy to raise (raising one stored instance from many threads would share,
        and grow, its traceback)."""
        return ChatTemplateInvalid(self.source, self.line, self.reason)


def compile_chat_template(text: object, source: str) -> jinja2.Template:
    """``text`` compiled as a chat template, in the sandbox every template renders in;
    `ChatTemplateInvalid` naming ``source`` when it is not text or does not parse."""
    if not isinstance(text, str):
        raise ChatTemplateInvalid(source, None, f"not text but a {type(text).__name__}")
    try:
        return _jinja_env().from_string(text)
    except jinja2.TemplateSyntaxError as exc:  # and TemplateAssertionError (unknown filter)
        raise ChatTemplateInvalid(source, exc.lineno, exc.message or str(exc)) from None
    except (jinja2.TemplateError, RecursionError) as exc:  # nested past the parser's stack
        raise ChatTemplateInvalid(source, None, f"{type(exc).__name__}: {exc}") from None


class TokenCodec(Protocol):
    """What `Tokenizer` needs of a backend: text <-> ids, and which ids are special (the
    tokens a chat template writes as markers, and ``skip_special`` hides)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    @property
    def special_text_ids(self) -> dict[str, int]: ...

    def token_to_id(self, text: str) -> int | None: ...

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Ids of ``text`` (no BOS); ``parse_special=False`` reads special-token text as
        the plain text it is."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str: ...


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    ``chat_template_source`` names where ``chat_template`` came from (``path [key]``), for
    `ChatTemplateInvalid` and the load's warning."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        chat_template: str | None,
        add_bos: bool = False,
        chat_template_source: str = SET_TEMPLATE_SOURCE,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos = add_bos
        self._codec: TokenCodec = backend if isinstance(backend, SpmVocab) else _HFCodec(backend)
        self._special_ids = self._codec.special_ids
        self.set_chat_template(chat_template, source=chat_template_source)

    @property
    def chat_template(self) -> str | None:
        """The chat template's text as the model gave it (None: it has none), kept when it
        does not parse (then `chat_template_error` says why). Setting it compiles it."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, text: str | None) -> None:
        self.set_chat_template(text, source=SET_TEMPLATE_SOURCE)

    @property
    def chat_template_error(self) -> ChatTemplateInvalid | None:
        """Why the chat template does not parse (None when it does, or there is none)."""
        return self._template_error

    def set_chat_template(self, text: str | None, *, source: str) -> None:
        """Use ``text`` as the chat template (None: none), compiled now. One that does not
        parse is kept with its error and a warning naming ``source``: the model still
        serves plain prompts, and chat renderings raise `ChatTemplateInvalid`."""
        self._chat_template = text
        self._template: jinja2.Template | None = None
        self._template_error: ChatTemplateInvalid | None = None
        if not text:
            return
        try:
            self._template = compile_chat_template(text, source)
        except ChatTemplateInvalid as exc:
            self._template_error = exc.with_traceback(None)  # kept: holds no frames
            log.warning("WARNING: %s; plain prompts still work", exc)

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer, as one JSON string."""
        backend: dict[str, Any] = (
            {"spm": self.backend.to_dict()}
            if isinstance(self.backend, SpmVocab)
            else {"backend": self.backend.to_str()}
        )
        return json.dumps(
            {
                **backend,
                "bos_id": self.bos_id,
                "eos_ids": list(self.eos_ids),
                "chat_template": self.chat_template,
                "add_bos": self.add_bos,
            }
        )

    @classmethod
    def from_json(cls, text: str, *, chat_template_source: str = SET_TEMPLATE_SOURCE) -> Tokenizer:
        """The tokenizer `to_json` wrote; ``chat_template_source`` names the file read."""
        fields = json.loads(text)
        backend: Backend = (
            SpmVocab.from_dict(fields.pop("spm"))
            if "spm" in fields
            else tokenizers.Tokenizer.from_str(fields.pop("backend"))
        )
        return cls(backend, **fields, chat_template_source=chat_template_source)

    @property
    def vocab_size(self) -> int:
        return self._codec.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._codec.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) are
        parsed as such. A BOS is prepended when ``add_bos`` (default: the model's rule).

        Never pass text that holds user input through this to build a chat prompt: a user
        who types ``<|im_end|>`` would end their turn. Use `encode_chat` for that."""
        return self._with_bos(self._codec.encode(text), add_bos)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template, for the model to read.

        The template's own markers (``<|im_start|>``, ``<|im_end|>``, ``bos_token`` …) are
        special tokens; special-token text inside the messages (content, names, any string
        a client sent) is encoded as the plain text it is. For messages without such text
        the result equals ``encode(render_chat(messages))``. The BOS rule is `encode`'s.
        ``tools`` (the template's ``tools`` variable) and ``template_kwargs`` (more variables,
        as transformers' ``apply_chat_template(**kwargs)``: ``enable_thinking``) are escaped
        as the messages are.
        """
        nonce = secrets.token_hex(8)
        escaped = [_escape_specials(message, self._special_pattern, nonce) for message in messages]
        offered = None if tools is None else _escape_specials(tools, self._special_pattern, nonce)
        extra = _escape_specials(dict(template_kwargs or {}), self._special_pattern, nonce)
        rendered = self.render_chat(
            escaped,
            add_generation_prompt=add_generation_prompt,
            tools=offered,
            template_kwargs=extra,
        )
        ids: list[int] = []
        for index, piece in enumerate(_split_keeping(self._special_pattern, rendered)):
            if index % 2:  # a special token the template wrote
                ids.append(self._special_text_ids[piece])
            elif piece:
                ids.extend(self._codec.encode(_unescape(piece, nonce), parse_special=False))
        return self._with_bos(ids, None)

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    @functools.cached_property
    def _special_text_ids(self) -> dict[str, int]:
        return self._codec.special_text_ids

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        """Matches special-token text leftmost-longest, as the backend's added-token
        matcher does (longest alternatives first)."""
        texts = sorted(self._special_text_ids, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self._codec.decode(ids, skip_special=skip_special)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template (as transformers does), with
        ``tools`` as its ``tools`` variable when given (left undefined otherwise, as
        transformers leaves it) and ``template_kwargs`` as more variables (they never
        replace the ones named here). Raises `ChatTemplateMissing` when the model has
        none, `ChatTemplateInvalid` (one of those) when its template does not parse."""
        if self._template_error is not None:
            raise self._template_error.again()
        template = self._template
        if template is None:
            raise ChatTemplateMissing
        bos = self.decode([self.bos_id]) if self.bos_id is not None else ""
        eos = self.decode([self.eos_ids[0]]) if self.eos_ids else ""
        offered = {} if tools is None else {"tools": list(tools)}
        own = {
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos,
            "eos_token": eos,
            **offered,
        }
        return template.render({**dict(template_kwargs or {}), **own})

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


class _HFCodec:
    """`TokenCodec` over a Hugging Face `tokenizers.Tokenizer`; special tokens are its
    added tokens marked special."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        decoder = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(index for index, token in decoder.items() if token.special)
        self.special_text_ids = {decoder[index].content: index for index in self.special_ids}

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, text: str) -> int | None:
        found = self.backend.token_to_id(text)
        return int(found) if found is not None else None

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        # One backend, and its encode_special_tokens flag (special-token text encoded as
        # ordinary text) set only for the call that asks, under a lock: the tokenizer is
        # used from several threads at once (server, engine, runner). A second backend
        # for text, the earlier way, held a copy of the vocabulary and merges, outside the
        # memory plan.
        with self._lock:
            self.backend.encode_special_tokens = not parse_special
            try:
                ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
            finally:
                self.backend.encode_special_tokens = False
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special))


# User-typed special-token text is swapped for a marker before the template runs (so the
# template can trim or split content as it likes) and swapped back after the template's
# own special tokens have been split off. Markers use private-use characters and a fresh
# nonce per call, so no user text can forge one.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def _escape_specials(value: Any, pattern: re.Pattern[str] | None, nonce: str) -> Any:
    """``value`` (a message, or anything inside one) with special-token text replaced by
    markers; non-string leaves are kept as they are."""
    if isinstance(value, str):
        if pattern is None:
            return value
        return pattern.sub(
            lambda m: f"{_MARK_OPEN}{nonce}{m.group().encode().hex()}{_MARK_CLOSE}", value
        )
    if isinstance(value, Mapping):
        return {key: _escape_specials(item, pattern, nonce) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_escape_specials(item, pattern, nonce) for item in value]
    return value


def _unescape(text: str, nonce: str) -> str:
    marker = re.compile(f"{_MARK_OPEN}{nonce}([0-9a-f]*){_MARK_CLOSE}")
    restored = marker.sub(lambda m: bytes.fromhex(m.group(1)).decode(), text)
    if nonce in restored:
        raise ValueError(
            "the chat template cut a message's special-token text apart; encode_chat cannot "
            "tell template markers from user text here"
        )
    return restored


def _split_keeping(pattern: re.Pattern[str] | None, text: str) -> list[str]:
    """``text`` split at ``pattern``: text, match, text, match, …, text."""
    if pattern is None:
        return [text]
    pieces: list[str] = []
    start = 0
    for match in pattern.finditer(text):
        pieces += [text[start : match.start()], match.group()]
        start = match.end()
    pieces.append(text[start:])
    return pieces


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@functools.cache
def _jinja_env() -> jinja2.Environment:
    """The one sandbox every chat template compiles and renders in (an environment is safe
    to share across threads once configured)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    return env


class StreamDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Byte-level BPE tokens and SentencePiece byte tokens (``<0xE6>``) can end in the middle
    of a multi-byte character; such a token decodes to U+FFFD. The delta is held back until
    a later token completes it. Decoding a short window (``prefix..end``) rather than the
    whole sequence keeps it O(1) per token and lets tokenizers that merge spaces across
    tokens decode correctly.
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
