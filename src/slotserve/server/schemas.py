"""Request bodies of the OpenAI-compatible routes, validated with pydantic.

Unknown fields are ignored (clients send more than we use); every known field is checked
with a message that names it and its limit. Every string a known field carries must be
valid Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer
or UTF-8 response can carry, so it is refused here (400 naming the field) and never reaches
them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Priority = Literal["interactive", "normal", "background"]


class InvalidText(ValueError):
    """A string that cannot be UTF-8; ``path`` says where it is inside the field's value
    (list indices and object keys), so the error can name the exact place."""

    def __init__(self, message: str, path: tuple[str | int, ...]) -> None:
        super().__init__(message)
        self.path = path


def check_unicode(value: Any, path: tuple[str | int, ...] = ()) -> None:
    """Raise `InvalidText` if a string inside ``value`` (a decoded JSON value: str, list,
    dict) cannot be encoded as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start]  # repr() spells it as an escape: the message stays ASCII
            raise InvalidText(
                f"the string holds a lone UTF-16 surrogate {bad!r} at index {exc.start}; "
                "send valid Unicode (a surrogate pair, or the character itself)",
                path,
            ) from None
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_unicode(item, (*path, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, (*path, key))


class Body(BaseModel):
    """A JSON object of a request: unknown fields ignored, every string valid Unicode.

    The check runs on the raw value of each field, before its type, so a failure is
    reported at the string itself (``messages.0.content``; `InvalidText.path`), never at
    a member of a type union.
    """

    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        check_unicode(value)
        return value


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    n: int | None = Field(default=None, ge=1, le=8)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Priority | None = None
    ignore_eos: bool = False  # extension (as vLLM): generate through end-of-sequence

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value

    def token_budget(self) -> int | None:
        """The requested number of new tokens (None: the rest of the context)."""
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the top k alternatives."""
        return None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ContentPart(Body):
    type: str
    text: str | None = None


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        batch = isinstance(value, list) and value and isinstance(value[0], (str, list))
        if batch and len(value) != 1:
            raise ValueError("prompt batches are not supported; send one prompt per request")
        if value in ("", []) or value == [[]]:
            raise ValueError("prompt must not be empty")
        return value

    def prompt_input(self) -> str | list[int]:
        value = self.prompt
        if isinstance(value, str):
            return value
        first = value[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return [int(t) for t in first]
        return [int(t) for t in value]  # type: ignore[arg-type]

    def token_budget(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(Body):
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    tokens: list[int]
