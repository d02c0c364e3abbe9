"""Response ids: ``kind-`` and 24 hex digits, never repeated by one server, and drawn
from a base of their own by each server (`ServerState.response_id`)."""

from __future__ import annotations

import re

from slotserve.server.http.state import ServerState


def test_ids_are_unique_per_server_and_differ_between_servers() -> None:
    one, two = ServerState(None, "m"), ServerState(None, "m")
    ids = [one.response_id("chatcmpl") for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{24}", i) for i in ids)
    fresh = ServerState(None, "m")  # the same count as `two`'s: its base tells them apart
    assert two.response_id("cmpl") != fresh.response_id("cmpl")
