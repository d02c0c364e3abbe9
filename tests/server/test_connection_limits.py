"""`HTTPLimits` (frozen, validated), the `ConnectionTracker`'s places and counts (the caps,
loopback clients sharing only the total cap, the longest-idle connection making room; a
hypothesis state machine), the flags that set them, and the key checked from the request
head on every keyed route (issue 31). The real server under slow clients, the caps and a
client holding idle connections: tests/reliability/test_slow_clients.py."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slotserve.cli import build_parser, main
from slotserve.cli import serve as serve_cli
from slotserve.server import create_app, routes
from slotserve.server.http.connections import (
    IDLE_GRACE_S,
    ConnectionTracker,
    HTTPLimits,
    is_loopback,
)
from slotserve.server.http.security import KEY_DEPENDENCIES, KeyedRoute
from slotserve.server.http.serve import warn_if_descriptors_short
from slotserve.server.ops import dashboard, page


def test_cli_defaults_are_the_limits_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    limits = HTTPLimits()
    assert args.header_timeout == serve_cli.DEFAULT_HEADER_TIMEOUT_S == limits.header_timeout_s
    assert args.body_timeout == serve_cli.DEFAULT_BODY_TIMEOUT_S == limits.body_timeout_s
    assert args.max_connections == serve_cli.DEFAULT_MAX_CONNECTIONS == limits.max_connections
    assert (
        args.max_connections_per_client
        == serve_cli.DEFAULT_MAX_CONNECTIONS_PER_CLIENT
        == limits.max_connections_per_client
    )


def test_limits_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        HTTPLimits().body_timeout_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("header_timeout_s", 0, "--header-timeout"),
        ("body_timeout_s", -1.0, "--body-timeout"),
        ("body_timeout_s", math.nan, "--body-timeout"),
        ("body_timeout_s", math.inf, "--body-timeout"),
        ("body_timeout_s", "5", "--body-timeout"),
        ("max_connections", 0, "--max-connections"),
        ("max_connections", 2.5, "--max-connections"),
        ("max_connections", True, "--max-connections"),
        ("max_connections_per_client", -3, "--max-connections-per-client"),
    ],
)
def test_invalid_limits_name_the_value_the_flag_and_the_default(
    field: str, value: object, flag: str
) -> None:
    with pytest.raises(ValueError) as refused:
        HTTPLimits(**{field: value})  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"{field}={value!r}" in message and flag in message
    if not isinstance(value, str):
        assert "default" in message


def test_serve_refuses_bad_limits_before_loading_a_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The model does not exist: the limits are checked first, so their error is the one.
    status = main(["serve", "--model", "/no/such/model", "--body-timeout", "0"])
    assert status == 2
    assert "body_timeout_s=0.0 (--body-timeout)" in capsys.readouterr().err


class Connection:
    """A place in the tracker, as `protocol.LimitedProtocol` is one: closed when evicted."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        assert not self.evicted, "evicted twice"
        self.evicted = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tracker_counts_places_by_address_and_refusals() -> None:
    """Remote addresses (here not even IPs): both caps; every connection kept busy."""
    tracker = ConnectionTracker(HTTPLimits(max_connections=3, max_connections_per_client=2))
    places = {name: Connection(name) for name in ("a1", "a2", "a3", "b", "c1", "c2")}

    def admit(name: str) -> str | None:
        place = places[name]
        refused = tracker.admit(name[0], place)
        if refused is None:
            tracker.busy(place)  # inside a request at once
        tracker.check_integrity()
        return refused

    assert admit("a1") is None and admit("a2") is None
    assert admit("a3") == "max_connections_per_client"
    assert "this client (a) has 2 connections open" in tracker.refusal_message(
        "max_connections_per_client", "a"
    )
    assert admit("b") is None
    assert admit("c1") == "max_connections"
    message = tracker.refusal_message("max_connections", "c")
    assert "3 connections open" in message and "--max-connections 3" in message
    assert "inside a request" in message
    tracker.release(places["a1"])
    tracker.release(places["a1"])  # twice: nothing more
    assert admit("c2") is None  # a closed connection freed its place
    tracker.timeout("body")
    stats = tracker.stats()
    assert stats.open == 3 and stats.max_connections == 3 and stats.evicted == 0
    assert stats.refused == {"max_connections": 1, "max_connections_per_client": 1}
    assert stats.timed_out == {"head": 0, "body": 1}
    assert not any(place.evicted for place in places.values())
    for name in ("a2", "b", "c2"):
        tracker.release(places[name])
    tracker.check_integrity()
    assert tracker.open == 0 and not tracker.by_client


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1", ""])
def test_loopback_clients_share_only_the_total_cap(address: str) -> None:
    """Every local app is 127.0.0.1: the per-address cap would let one lock out the rest."""
    assert is_loopback(address)
    tracker = ConnectionTracker(HTTPLimits(max_connections=5, max_connections_per_client=2))
    held = [Connection() for _ in range(5)]
    assert [tracker.admit(address, place) for place in held] == [None] * 5
    for place in held:
        tracker.busy(place)
    assert tracker.admit(address, Connection()) == "max_connections"
    tracker.check_integrity()


@pytest.mark.parametrize("address", ["10.0.0.2", "192.168.1.7", "::2", "::ffff:10.0.0.1", "x"])
def test_other_addresses_are_remote(address: str) -> None:
    assert not is_loopback(address)


def test_the_longest_idle_connection_makes_room_after_the_grace() -> None:
    clock = Clock()
    tracker = ConnectionTracker(HTTPLimits(max_connections=3), clock=clock)
    first, second, busy = Connection("first"), Connection("second"), Connection("busy")
    for place in (first, second, busy):
        assert tracker.admit("127.0.0.1", place) is None
        clock.now += 0.1
    tracker.busy(busy)
    # Idle for under the grace: a fresh connection's first bytes may still be on their way.
    assert tracker.admit("127.0.0.1", Connection()) == "max_connections"
    clock.now = 100.0 + IDLE_GRACE_S
    newcomer = Connection("newcomer")
    assert tracker.admit("127.0.0.1", newcomer) is None
    assert first.evicted and not second.evicted and not busy.evicted
    tracker.check_integrity()
    # A place that served a request is idle again from its response's end.
    tracker.busy(second)
    clock.now += 5
    tracker.idle(second)
    assert tracker.admit("127.0.0.1", Connection()) is None  # the newcomer, idle longest
    assert newcomer.evicted and not second.evicted
    tracker.release(first)  # its connection_lost, after the eviction: nothing to free
    tracker.check_integrity()
    assert tracker.open == 3 and tracker.stats().evicted == 2
    assert tracker.stats().refused["max_connections"] == 1


def test_busy_connections_are_never_closed_for_room() -> None:
    clock = Clock()
    tracker = ConnectionTracker(HTTPLimits(max_connections=2), clock=clock)
    held = [Connection(), Connection()]
    for place in held:
        tracker.admit("127.0.0.1", place)
        tracker.busy(place)
    clock.now += 3600
    assert tracker.admit("127.0.0.1", Connection()) == "max_connections"
    assert not any(place.evicted for place in held)
    tracker.idle(held[1])
    assert tracker.admit("127.0.0.1", Connection()) == "max_connections"  # idle just now
    clock.now += IDLE_GRACE_S
    assert tracker.admit("127.0.0.1", Connection()) is None and held[1].evicted


def test_a_remote_client_at_its_cap_closes_its_own_idle_connection() -> None:
    clock = Clock()
    limits = HTTPLimits(max_connections=10, max_connections_per_client=2)
    tracker = ConnectionTracker(limits, clock=clock)
    other = Connection("other")
    tracker.admit("10.0.0.9", other)  # idle the longest, but another client's
    clock.now += 1
    mine = [Connection("mine0"), Connection("mine1")]
    for place in mine:
        tracker.admit("10.0.0.2", place)
    tracker.busy(mine[0])
    clock.now += IDLE_GRACE_S
    newcomer = Connection("newcomer")
    assert tracker.admit("10.0.0.2", newcomer) is None
    assert mine[1].evicted and not mine[0].evicted and not other.evicted
    assert tracker.by_client["10.0.0.2"] == 2
    tracker.busy(newcomer)
    clock.now += IDLE_GRACE_S
    assert tracker.admit("10.0.0.2", Connection()) == "max_connections_per_client"
    assert not other.evicted
    tracker.check_integrity()


class TrackerMachine(RuleBasedStateMachine):
    """Random admissions, requests, responses, closes and waits: the invariants hold after
    every step, a busy connection is never closed for room, and a refusal means no idle
    connection had waited out the grace."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        limits = HTTPLimits(max_connections=4, max_connections_per_client=2)
        self.tracker = ConnectionTracker(limits, clock=self.clock)
        # Each open connection: its address, and since when it is idle (None: busy).
        self.open: dict[Connection, tuple[str, float | None]] = {}

    def _settled_idle(self, address: str | None) -> bool:
        settled = self.clock.now - IDLE_GRACE_S
        return any(
            since is not None and since <= settled and address in (None, owner)
            for owner, since in self.open.values()
        )

    def _pick(self, data: st.DataObject) -> Connection | None:
        if not self.open:
            return None
        return data.draw(st.sampled_from(sorted(self.open, key=lambda place: place.name)))

    @rule(address=st.sampled_from(["127.0.0.1", "127.0.0.2", "10.0.0.1", "10.0.0.2"]))
    def admit(self, address: str) -> None:
        place = Connection(f"{len(self.open)}-{self.clock.now}-{address}")
        remote_full = not is_loopback(address) and self.tracker.by_client[address] >= 2
        could_make_room = self._settled_idle(address if remote_full else None)
        full = remote_full or len(self.open) >= 4
        refused = self.tracker.admit(address, place)
        for other in [p for p in self.open if p.evicted]:
            assert self.open.pop(other)[1] is not None, "a busy connection was closed for room"
        if refused is None:
            assert not full or could_make_room
            self.open[place] = (address, self.clock.now)
        else:
            assert full and not could_make_room

    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        if (place := self._pick(data)) is not None:
            self.tracker.busy(place)
            self.open[place] = (self.open[place][0], None)

    @rule(data=st.data())
    def respond(self, data: st.DataObject) -> None:
        if (place := self._pick(data)) is not None:
            self.tracker.idle(place)
            self.open[place] = (self.open[place][0], self.clock.now)

    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        if (place := self._pick(data)) is not None:
            self.tracker.release(place)
            del self.open[place]

    @rule(seconds=st.sampled_from([0.1, 0.5, IDLE_GRACE_S, 3.0]))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def holds(self) -> None:
        self.tracker.check_integrity()
        assert self.tracker.open == len(self.open) <= 4
        for address in ("10.0.0.1", "10.0.0.2"):
            assert self.tracker.by_client[address] <= 2


TrackerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
test_tracker_state_machine = TrackerMachine.TestCase


def test_every_keyed_route_checks_its_key_from_the_head() -> None:
    keyed = 0
    for router in (routes.v1, routes.guarded, routes.plain, dashboard.router, page.router):
        for route in router.routes:
            assert isinstance(route, APIRoute)
            calls = {getattr(depends, "dependency", None) for depends in route.dependencies}
            if calls & set(KEY_DEPENDENCIES):
                keyed += 1
                assert isinstance(route, KeyedRoute), route.path
    assert keyed >= 9  # chat, completions, 2 models, slots, 2 tokenize, metrics, feed


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_invalid_json_without_the_key_is_401_not_400(path: str) -> None:
    client = TestClient(create_app(None, "m", api_key="k"))
    bad = b'{"model": '
    response = client.post(path, content=bad, headers={"Content-Type": "application/json"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["connection"] == "close"  # its body was announced, never read
    keyed = client.post(
        path,
        content=bad,
        headers={"Content-Type": "application/json", "Authorization": "Bearer k"},
    )
    assert keyed.status_code == 400 and "not valid JSON" in keyed.json()["error"]["message"]


def test_get_without_the_key_keeps_the_connection() -> None:
    client = TestClient(create_app(None, "m", api_key="k"))
    response = client.get("/v1/models")
    assert response.status_code == 401 and "connection" not in response.headers
    assert client.get("/v1/models", headers={"X-Api-Key": "k"}).status_code == 200


def test_metrics_key_is_checked_from_the_head_too() -> None:
    client = TestClient(create_app(None, "m", metrics_key="mk"))
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"X-Api-Key": "mk"}).status_code == 503  # no engine


def test_descriptor_limit_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        assert not warn_if_descriptors_short(1)
        short = warn_if_descriptors_short(1 << 40)
    if short:  # unless the limit is infinite
        assert "--max-connections 1099511627776" in caplog.text and "ulimit -n" in caplog.text
