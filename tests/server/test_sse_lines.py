"""An event's JSON is one line for every reader of the stream: a token that decodes to a
character `str.splitlines` breaks at (NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR) is escaped,
since httpx's ``iter_lines`` and many hand-written SSE readers split that way (a random
model's tool arguments once held one, and the conformance test read half an event)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from slotserve.server.anthropic.reply import event
from slotserve.server.openai.replies import sse


@given(st.text())
def test_every_event_is_one_line_that_decodes_to_its_payload(text: str) -> None:
    payload = {"delta": {"partial_json": text}, "sep": "\x85\u2028\u2029"}
    for frame in (sse(payload), event("content_block_delta", **payload)):
        assert frame.endswith("\n\n")
        lines = frame[:-2].splitlines()
        assert len(lines) == frame.count("\n") - 1  # splitlines breaks only at the SSE's LFs
        data = lines[-1].removeprefix("data: ")
        assert json.loads(data)["delta"]["partial_json"] == text
