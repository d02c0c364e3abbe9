"""Request bodies of the OpenAI-compatible routes, validated with pydantic.

Fields of OpenAI's request schemas that the server does not implement are refused (400
``unsupported_parameter`` naming the field; `UNSUPPORTED` is the one list), unless their
value asks for nothing (``functions: []``, ``modalities: ["text"]``). Fields that change nothing
here (`NO_OPS`: ``user``, ``store``, ``metadata`` …) are accepted. llama.cpp's server's and
vLLM's fields are implemented (grammars, samplers: `SamplingFields`) or refused the same way
(`peer_fields`). A chat or completions field no API defines is ignored and reported (the
``X-Slotserve-Ignored-Fields`` header: `peer_fields.ignored_fields`). Every known field is
checked with a message
that names it and its limit. Every string a known field carries must be
valid Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer
or UTF-8 response can carry, so it is refused here (400 naming the field) and never reaches
them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from slotserve.engine.events import Priority
from slotserve.server.chat.reasoning import ReasoningFormat
from slotserve.server.openai.peer_fields import ignored_fields, refused_field
from slotserve.server.openai.tool_specs import ToolCall, ToolChoice, ToolSpec

UNSUPPORTED_PARAMETER = "unsupported_parameter"


def _empty(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value == [] or value == {}


def _no_tool_call(value: Any, body: dict[str, Any]) -> bool:
    return value in (None, "none", "auto")


def _text_only(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value == ["text"]


def _one_per_choice(value: Any, body: dict[str, Any]) -> bool:
    n = body.get("n") or 1
    return value is None or (type(value) is int and value == n)  # a boolean is no count


def _default_verbosity(value: Any, body: dict[str, Any]) -> bool:
    return value in (None, "medium")


# Fields of OpenAI's chat and completions requests this server does not implement, each with
# the test for values that ask nothing of it (accepted). Any other value is refused: 400
# unsupported_parameter naming the field. tests/server/test_unsupported.py checks that every
# field of the spec is implemented, in NO_OPS, or here.
UNSUPPORTED: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "functions": _empty,  # the deprecated form of tools
    "function_call": _no_tool_call,
    "audio": _empty,
    "modalities": _text_only,
    "web_search_options": _empty,
    "reasoning_effort": _empty,
    "verbosity": _default_verbosity,
    "moderation": _empty,
    "suffix": lambda value, body: value in (None, ""),
    "best_of": _one_per_choice,  # best_of == n is plain sampling
}
# Fields accepted whatever their value, because honouring them changes no output: tags and
# storage (we store nothing), billing and caching hints, and a prediction (it only speeds
# up a response whose content stays the same).
NO_OPS = frozenset(
    {
        "user",
        "store",
        "metadata",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "prediction",
    }
)


def refuse_unsupported(body: dict[str, Any], chat: bool = True) -> None:
    """Raise a pydantic ``unsupported_parameter`` error naming the first field of ``body``
    that asks for something this server does not do: OpenAI's (`UNSUPPORTED`), llama.cpp's
    or vLLM's (`peer_fields`)."""
    refused = next(
        (
            (name, body[name])
            for name, ok in UNSUPPORTED.items()
            if name in body and not ok(body[name], body)
        ),
        None,
    ) or refused_field(body, chat)
    if refused is not None:
        name, value = refused
        raise PydanticCustomError(
            UNSUPPORTED_PARAMETER,
            "{param}: this server does not support this parameter (value {value}); remove it",
            {"param": name, "value": repr(value)[:80]},
        )


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
    """A JSON object of a request: unknown fields ignored, every string valid Unicode,
    every field strictly typed as OpenAI's API types it (pydantic's strict mode): an
    integer is not a boolean, a string or a decimal number (``max_tokens: "5"``,
    ``n: true`` and ``max_tokens: 5.0`` are refused), a number is not a boolean, a boolean
    only ``true`` or ``false``. Subclasses keep strict mode (their ``model_config`` is
    merged with this one). `validation.describe` turns a failure into the 400.

    The Unicode check runs on the raw value of each field, before its type, so a failure
    is reported at the string itself (``messages.0.content``; `InvalidText.path`), never at
    a member of a type union.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        check_unicode(value)
        return value


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    """``response_format.json_schema``: the schema the output must validate against."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: stored as schema_, sent as "schema".
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """``response_format``: plain text, any JSON object, or JSON matching a schema (as
    ``json_schema.schema``, or as llama.cpp's ``schema`` beside ``type: json_object``)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's extension; an object or its JSON text (`structured._json_schema`)
    schema_: dict[str, Any] | str | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object with a schema')
        return self


# OpenAI's range for a logit bias; keys are token ids written as strings of ASCII digits
# (str.isdigit would take "٣", an Arabic-Indic three, and int() would read it as 3).
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]
TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
# The seeds the sampler takes: any 64-bit integer, signed or not.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: one constraint on the output (`structured`)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # the output's JSON has no free whitespace
    disable_fallback: bool | None = None  # there is one grammar engine: never a fallback
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    @model_validator(mode="after")
    def _supported(self) -> StructuredOutputs:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this server; remove it")
        if self.disable_additional_properties:
            raise ValueError(
                "disable_additional_properties is not supported by this server: give the "
                'schema "additionalProperties": false instead'
            )
        return self


# llama.cpp's default DRY sequence breakers.
DRY_BREAKERS = ("\n", ":", '"', "*")


class SamplingFields(Body):
    """Fields shared by chat and text completions. Fields no API defines are kept apart
    (``model_extra``) to be reported, never used."""

    model_config = ConfigDict(extra="allow", strict=True)
    CHAT: ClassVar[bool] = False

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
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
    response_format: ResponseFormat | None = None  # also on completions (as vLLM)
    logit_bias: dict[str, LogitBias] | None = None
    # Other servers' names: llama.cpp's for max_tokens (-1: the rest of the context) and
    # repetition_penalty.
    n_predict: int | None = Field(default=None, ge=-1)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    # llama.cpp's: its ``timings`` object on the reply and each chunk (`llama_timings`).
    timings_per_token: bool | None = None
    # Grammars other servers take; at most one constraint a request (`structured`).
    grammar: str | None = None  # llama.cpp: GBNF (Lark passes through)
    json_schema: dict[str, Any] | None = None  # llama.cpp: the output's JSON schema
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer form
    # Samplers of llama.cpp's server (min_tokens: vLLM's), each as its server defines it
    # (`slotserve.sampling.chain`).
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_n_sigma: float | None = Field(default=None, ge=-1.0, le=100.0)
    xtc_probability: float | None = Field(default=None, ge=0.0, le=1.0)
    xtc_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    dry_multiplier: float | None = Field(default=None, ge=0.0, le=100.0)
    dry_base: float | None = Field(default=None, ge=1.0, le=100.0)
    dry_allowed_length: int | None = Field(default=None, ge=0, le=1024)
    dry_penalty_last_n: int | None = Field(default=None, ge=-1)
    # At most 16, each read up to 40 characters (llama.cpp's cut): each is looked for in
    # every token's text once (`samplers.dry_breakers`), off the event loop.
    dry_sequence_breakers: list[str] | None = Field(default=None, min_length=1, max_length=16)
    min_tokens: int | None = Field(default=None, ge=0)
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: float | None = Field(default=None, ge=0.0, le=100.0)
    mirostat_eta: float | None = Field(default=None, ge=0.0, le=10.0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unsupported(data, cls.CHAT)
        return data

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not breaker for breaker in value):
            raise ValueError("each sequence breaker is a non-empty string")
        return value

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not choice for choice in value):
            raise ValueError("each choice is a non-empty string")
        return value

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> SamplingFields:
        budget = self.token_budget()
        if self.min_tokens and budget is not None and self.min_tokens > budget:
            raise ValueError(
                f"min_tokens={self.min_tokens} is more than the token budget {budget}; "
                "lower min_tokens or raise max_tokens"
            )
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(
                    f"key {key!r} is not a token id: write each token id in ASCII digits "
                    '(as "50256")'
                )
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs (ids not yet checked against a vocabulary)."""
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value

    def token_budget(self) -> int | None:
        """The requested number of new tokens (None: the rest of the context)."""
        return self.max_tokens or self._predicted()

    def _predicted(self) -> int | None:
        """llama.cpp's ``n_predict`` as a budget (-1 or 0: none)."""
        return self.n_predict if self.n_predict is not None and self.n_predict > 0 else None

    def ignored(self) -> list[str]:
        """The fields of the request no API defines (reported, never used)."""
        return ignored_fields(self.model_extra)

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
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (`tools` renders them)
    tool_call_id: str | None = None  # the call a tool message answers
    # An assistant turn's past thinking, as llama.cpp's server and DeepSeek send it back
    # (``reasoning``: vLLM's newer name); the template gets it as ``reasoning_content``.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def past_reasoning(self) -> str | None:
        """The thinking an assistant turn sent back (None: none, or not an assistant's)."""
        if self.role != "assistant":
            return None
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        # Parts are separate pieces of text: joined with a line break, never run together.
        return "\n".join(part.text or "" for part in self.content)


# The chat template's own variables, which chat_template_kwargs may not set.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs``: more variables for the chat template (``enable_thinking``),
    never one of the variables the server sets itself."""
    for key in value or {}:
        if key in TEMPLATE_VARIABLES:
            raise ValueError(
                f"{key!r} is the chat template's own variable, which the server sets; remove it"
            )
    return value


class ChatCompletionRequest(SamplingFields):
    CHAT: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None  # tool calling: `tools.plan_tools`
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extensions, as llama.cpp's server and vLLM take them: variables for the chat
    # template, and whether a thinking section is returned apart (`reasoning`).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: ReasoningFormat | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens or self._predicted()

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
        given = "max_tokens" in self.model_fields_set and self.max_tokens is not None
        if self.n_predict is not None and not given:
            return self._predicted()  # llama.cpp's name given instead of the default 16
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(Body):
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)


class ApplyTemplateRequest(Body):
    """llama.cpp's ``/apply-template``: a chat request's messages and tools, rendered by the
    chat template as its prompt text (``model``: the model's, by default the one served)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    def chat(self, model: str) -> ChatCompletionRequest:
        """The chat request these fields make (checked already; its other fields unset)."""
        return ChatCompletionRequest.model_construct(
            model=model,
            messages=self.messages,
            tools=self.tools,
            tool_choice=self.tool_choice,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(Body):
    tokens: list[int]
