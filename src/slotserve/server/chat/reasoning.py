"""Reasoning: a reply's thinking section (``<think>…</think>``, as Qwen3 and DeepSeek-R1
write it) told apart from its answer, whole or as it streams.

A model thinks when its chat template mentions ``<think>`` or its vocabulary holds both
``<think>`` and ``</think>`` as tokens (`thinks`). For such a model, a reply's section is
returned apart from its content (chat's ``reasoning_content``, the Responses API's
reasoning item, Anthropic's ``thinking`` block) unless ``reasoning_format`` is ``none``
(the request's field, else the server's ``--reasoning-format``; llama.cpp's names): then
it stays inline in the content, as the model wrote it. The section is the reply's opening
``<think>`` (after any whitespace) up to ``</think>``; when the prompt itself ends inside
an open section (a template whose generation prompt writes ``<think>``), the reply begins
in it (`Reasoning.starts_open`). A section never closed runs to the end of the reply.
Whitespace around the section's text and before the content that follows it is dropped
(the template puts it there; nothing of the answer).

A reply decoded under a grammar from its first token (``response_format``, or a tool
choice of ``required`` or a named function) writes its document or call at once: it has no
section, and is not read for one (`plan_reasoning` is not asked).

Pure functions of text and token ids, plus `ReasoningSplitter`'s per-reply state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from slotserve.tokenizer import Tokenizer

ReasoningFormat = Literal["auto", "none"]
REASONING_FORMATS: tuple[ReasoningFormat, ...] = ("auto", "none")
OPEN, CLOSE = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 16  # how far back the prompt is read for an open section
Part = tuple[Literal["reasoning", "content"], str]


def thinks(tokenizer: Tokenizer) -> bool:
    """Whether this model writes thinking sections: its template mentions ``<think>``, or
    ``<think>`` and ``</think>`` are tokens of its vocabulary."""
    if OPEN in (tokenizer.chat_template or ""):
        return True
    return tokenizer.token_to_id(OPEN) is not None and tokenizer.token_to_id(CLOSE) is not None


@dataclass(frozen=True)
class Reasoning:
    """How one reply's thinking is read: ``starts_open`` when its prompt ends inside an
    open section; ``markers``: the section's tags that are special tokens (id → text),
    which the engine's text leaves out and the reply's text gets back."""

    starts_open: bool
    markers: dict[int, str] = field(default_factory=dict)


def plan_reasoning(
    tokenizer: Tokenizer, prompt: list[int], reasoning_format: ReasoningFormat
) -> Reasoning | None:
    """How the reply to ``prompt`` is read for thinking; None: not at all (the format is
    ``none``, or the model does not think)."""
    if reasoning_format == "none" or not thinks(tokenizer):
        return None
    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:])
    opened, closed = tail.rfind(OPEN), tail.rfind(CLOSE)
    starts_open = opened >= 0 and opened > closed and not tail[opened + len(OPEN) :].strip()
    markers: dict[int, str] = {}
    for text in (OPEN, CLOSE):
        token = tokenizer.token_to_id(text)
        if token is not None and tokenizer.is_special(token):
            markers[token] = text
    return Reasoning(starts_open, markers)


def _held(text: str, literal: str) -> int:
    """How many characters at the end of ``text`` could begin ``literal``."""
    for size in range(min(len(literal) - 1, len(text)), 0, -1):
        if literal.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """One reply's text, pushed as it comes, split into reasoning and content parts.

    What could still be the start of a tag (``<thi``), or whitespace that may turn out
    to end the section, is held until the next push shows what it is; ``final`` sends
    everything. The parts of any split of a text into pushes join to the same reasoning
    and content as the text pushed whole (`split_reasoning`)."""

    def __init__(self, starts_open: bool) -> None:
        self.phase: Literal["start", "reasoning", "after", "content"] = (
            "reasoning" if starts_open else "start"
        )
        self.opened = starts_open  # the reply has a section (begun in the prompt or here)
        self._pending = ""  # text not yet sent
        self._space = ""  # whitespace after the reasoning sent so far, held
        self._reasoned = False  # some reasoning text was sent

    def push(self, text: str, *, final: bool = False) -> list[Part]:
        self._pending += text
        parts: list[Part] = []
        if self.phase == "start":
            head = self._pending.lstrip()
            if head.startswith(OPEN):
                self.phase, self.opened = "reasoning", True
                self._pending = head[len(OPEN) :]
            elif not final and OPEN.startswith(head):  # nothing yet, or "<thi"
                return parts
            else:
                self.phase = "content"
        if self.phase == "reasoning":
            at = self._pending.find(CLOSE)
            if at < 0:
                keep = 0 if final else _held(self._pending, CLOSE)
                body, self._pending = (
                    self._pending[: len(self._pending) - keep],
                    self._pending[len(self._pending) - keep :],
                )
                self._reason(body, parts, ends=final)
                return parts
            self._reason(self._pending[:at], parts, ends=True)
            self._pending = self._pending[at + len(CLOSE) :]
            self.phase = "after"
        if self.phase == "after":  # the whitespace between the section and the answer
            self._pending = self._pending.lstrip()
            if not self._pending:
                return parts
            self.phase = "content"
        if self._pending:
            parts.append(("content", self._pending))
            self._pending = ""
        return parts

    def _reason(self, body: str, parts: list[Part], *, ends: bool) -> None:
        if not self._reasoned:
            body = body.lstrip()
        text = self._space + body
        kept = text.rstrip()
        self._space = "" if ends else text[len(kept) :]
        if kept:
            parts.append(("reasoning", kept))
            self._reasoned = True


def split_reasoning(text: str, starts_open: bool) -> tuple[str | None, str]:
    """A whole reply's reasoning (None: it has no section, or an empty one) and content."""
    splitter = ReasoningSplitter(starts_open)
    parts = splitter.push(text, final=True)
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    content = "".join(t for kind, t in parts if kind == "content")
    return reasoning or None, content
