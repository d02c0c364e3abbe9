"""The request fields other OpenAI-compatible servers define (llama.cpp's server, vLLM)
that the chat and completions routes do not implement, and what a request meets for each.

The policy (docs/API.md, "Fields"): a field that OpenAI, llama.cpp's server or vLLM
defines is implemented (`schemas.SamplingFields` holds it), accepted because it changes no
output here (`PEER_NO_OPS`), or refused with a 400 ``unsupported_parameter`` naming it
unless its value asks for what the server does anyway (`PEER_UNSUPPORTED`, each with that
test). A field none of them defines is ignored, and reported back: the response's
``X-Slotserve-Ignored-Fields`` header lists it, and the server logs it (`ignored_fields`).

Pure data and tests of values; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Harmless = Callable[[Any, dict[str, Any]], bool]


def _absent(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _false(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value is False


def _true(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value is True


def _equals(*values: Any) -> Harmless:
    def harmless(value: Any, body: dict[str, Any]) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in values)

    return harmless


def _no_penalty_window(value: Any, body: dict[str, Any]) -> bool:
    """llama.cpp's ``repeat_last_n``: the penalties' window; the whole context (-1) is what
    the penalties here cover, and without a penalty in force no window matters."""
    penalised = any(
        body.get(name) not in (None, neutral)
        for name, neutral in (
            ("repeat_penalty", 1.0),
            ("repetition_penalty", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
        )
    )
    return value is None or value == -1 or not penalised


# llama.cpp's and vLLM's fields the server does not implement, each with the test for
# values that ask nothing of it (accepted). Any other value: 400 unsupported_parameter.
PEER_UNSUPPORTED: dict[str, Harmless] = {
    # llama.cpp's server
    "n_probs": _equals(0),
    "n_indent": _equals(0),
    "n_discard": _equals(0),
    "t_max_predict_ms": _equals(0),
    "min_keep": _equals(0),
    "samplers": _absent,
    "dynatemp_range": _equals(0, 0.0),
    "dynatemp_exponent": _equals(1, 1.0),
    "repeat_last_n": _no_penalty_window,
    "penalty_last_n": _no_penalty_window,
    "penalize_nl": _false,
    "tfs_z": _equals(1, 1.0),
    "grammar_lazy": _false,
    "grammar_triggers": _absent,
    "preserved_tokens": _absent,
    "post_sampling_probs": _false,
    "response_fields": _absent,
    "return_tokens": _false,
    "return_progress": _false,
    "lora": _absent,
    "image_data": _absent,
    "multimodal_data": _absent,
    # vLLM
    "use_beam_search": _false,
    "length_penalty": _equals(1, 1.0),
    "stop_token_ids": _absent,
    "include_stop_str_in_output": _false,
    "skip_special_tokens": _true,
    "spaces_between_special_tokens": _true,
    "truncate_prompt_tokens": _absent,
    "prompt_logprobs": _absent,
    "allowed_token_ids": _absent,
    "bad_words": _absent,
    "continue_final_message": _false,
    "documents": _absent,
    "chat_template": _absent,
    "mm_processor_kwargs": _absent,
    "structural_tag": _absent,
    "guided_whitespace_pattern": _absent,
    "logits_processors": _absent,
    "return_tokens_as_token_ids": _false,
    "return_token_ids": _false,
    "kv_transfer_params": _absent,
    "vllm_xargs": _absent,
    "prompt_embeds": _absent,
    "thinking_token_budget": _absent,
}
# Chat only: what these ask of a chat request is the chat template's ordinary rendering.
CHAT_UNSUPPORTED: dict[str, Harmless] = {
    "add_generation_prompt": _true,
    "add_special_tokens": _false,
    "echo": _false,
}
# llama.cpp's and vLLM's fields accepted whatever their value: they change no output here
# (caching hints, slot and backend choices, request tags).
PEER_NO_OPS = frozenset(
    {
        "cache_prompt",
        "id_slot",
        "n_keep",
        "n_cmpl",
        "guided_decoding_backend",
        "request_id",
        "cache_salt",
    }
)
IGNORED_FIELDS_HEADER = "X-Slotserve-Ignored-Fields"


def _all_unset(value: Any, body: dict[str, Any]) -> bool:
    """An object of options none of which is set (``reasoning: {"effort": null}``)."""
    return _absent(value, body) or (
        isinstance(value, dict) and all(v is None for v in value.values())
    )


# OpenAI's Responses API fields (beyond those `responses.request` reads or refuses itself),
# by the same rule: accepted whatever their value when they change no output here
# (billing, caching and routing hints; stream options for obfuscation padding, never
# sent), else refused unless their value asks for nothing.
RESPONSES_NO_OPS = frozenset(
    {
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "stream_options",
    }
)
RESPONSES_UNSUPPORTED: dict[str, Harmless] = {
    "max_tool_calls": _absent,
    "top_logprobs": _equals(0),
    "prompt": _absent,
    "reasoning": _all_unset,  # a thinking model's thinking: chat_template_kwargs
    "context_management": _absent,
    "background_options": _absent,
    "access_programs": _absent,
    "moderation": _absent,
    "image": _absent,
    "cyber": _absent,
}
# Anthropic's Messages API fields the server does not read: hints that change no output
# here, and features refused unless their value asks for nothing.
ANTHROPIC_NO_OPS = frozenset(
    {
        "cache_control",
        "inference_geo",
        "service_tier",
        "speed",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
        "betas",
        "billing_policy",
        "fallback_credit_token",
        "fallbacks",
    }
)
ANTHROPIC_UNSUPPORTED: dict[str, Harmless] = {
    "container": _absent,
    "context_management": _absent,
    "mcp_servers": _absent,
    "output_config": _all_unset,
    "compaction": _absent,
    "thread": _absent,
}


def refused_field(body: dict[str, Any], chat: bool) -> tuple[str, Any] | None:
    """The first field of ``body`` (name, value) this server refuses, if any."""
    tables = (PEER_UNSUPPORTED, CHAT_UNSUPPORTED) if chat else (PEER_UNSUPPORTED,)
    for table in tables:
        for name, harmless in table.items():
            if name in body and not harmless(body[name], body):
                return name, body[name]
    return None


def refused_in(table: dict[str, Harmless], body: dict[str, Any]) -> tuple[str, Any] | None:
    """The first field of ``body`` (name, value) that ``table`` refuses, if any."""
    for name, harmless in table.items():
        if name in body and not harmless(body[name], body):
            return name, body[name]
    return None


def ignored_fields(
    extra: dict[str, Any] | None, known: frozenset[str] | set[str] = PEER_NO_OPS
) -> list[str]:
    """The fields of a request that no API this server follows defines (pydantic's
    ``model_extra``), sorted; ``known`` (the API's no-ops, and the unsupported fields whose
    value asked for nothing) are not listed."""
    return sorted(name for name in extra or {} if name not in known)


def ignored_header(names: list[str]) -> dict[str, str]:
    """The header that reports ``names`` (none: no header). Field names are the client's
    JSON keys, any string: each is shown in visible ASCII (a space, a comma or any other
    character becomes ``?``, so the value never starts or ends with whitespace, which HTTP
    forbids), at most 64 characters of each of the first 32."""
    if not names:
        return {}
    text = ",".join(
        "".join(ch if "!" <= ch <= "~" and ch != "," else "?" for ch in name[:64])
        for name in names[:32]
    )
    return {IGNORED_FIELDS_HEADER: text}
