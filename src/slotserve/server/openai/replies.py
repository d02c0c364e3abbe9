"""Building OpenAI response objects and SSE chunks from engine events."""

from __future__ import annotations

import json
from typing import Any

from slotserve.engine.events import Finished, TokenEvent
from slotserve.tokenizer import Tokenizer

# Requests that end "cancelled" or "error" never reach a client as a normal finish (the
# routes answer 503/500, or end the stream with an error event); "stop" is their fallback.
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "error": "stop"}


def sse_json(payload: dict[str, Any]) -> str:
    """``payload`` as one line of JSON for an event stream. SSE ends a line only at CR or LF,
    which JSON always escapes, but many readers split a stream with `str.splitlines` (httpx's
    ``iter_lines`` among them), which also ends lines at NEL, LINE SEPARATOR and PARAGRAPH
    SEPARATOR; JSON may escape any character, so those three go out as ``\\uXXXX`` too and a
    token that decodes to one cannot cut its event in two."""
    data = json.dumps(payload, ensure_ascii=False)
    return data.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else sse_json(payload)
    return f"data: {data}\n\n"


def usage(finals: list[Finished]) -> dict[str, Any]:
    prompt = finals[0].usage.prompt_tokens if finals else 0
    completion = sum(f.usage.completion_tokens for f in finals)
    cached = finals[0].usage.cached_tokens if finals else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, events: list[TokenEvent]) -> dict[str, Any]:
    content = []
    for event in events:
        if event.token_id < 0 or event.logprob is None:
            continue
        entry = _token_entry(tokenizer, event.token_id, event.logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in event.top_logprobs]
        content.append(entry)
    return {"content": content, "refusal": None}


def text_logprobs(tokenizer: Tokenizer, events: list[TokenEvent], offset: int) -> dict[str, Any]:
    tokens, logprobs, tops, offsets = [], [], [], []
    for event in events:
        if event.token_id < 0 or event.logprob is None:
            continue
        text = tokenizer.decode([event.token_id])
        tokens.append(text)
        logprobs.append(event.logprob)
        tops.append({tokenizer.decode([t]): lp for t, lp in event.top_logprobs})
        offsets.append(offset)
        offset += len(event.text)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def text_choice(
    index: int, text: str, final: Finished, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "finish_reason": FINISH_REASONS[final.reason],
        "logprobs": logprobs,
    }


def role_delta() -> dict[str, Any]:
    """A chat stream's first delta for a choice: the role, no content yet (``null``, as
    OpenAI's tool-call streams and llama.cpp's server begin every stream; OpenAI's types
    allow it, and llama.cpp's clients take a content delta for text) and no refusal."""
    return {"role": "assistant", "content": None, "refusal": None}


def envelope(kind: str, request_id: str, created: int, model: str) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created, "model": model}
