"""`HTTPLimits` (frozen, validated), the `ConnectionTracker`'s counts, the flags that set
them, and the key checked from the request head on every keyed route (issue 31). The real
server under slow clients and the caps: tests/reliability/test_slow_clients.py."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from slotserve.cli import build_parser, main
from slotserve.cli import serve as serve_cli
from slotserve.server import create_app, dashboard, page, routes
from slotserve.server.connections import ConnectionTracker, HTTPLimits
from slotserve.server.run import warn_if_descriptors_short
from slotserve.server.security import KEY_DEPENDENCIES, KeyedRoute


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


def test_tracker_counts_places_by_address_and_refusals() -> None:
    tracker = ConnectionTracker(HTTPLimits(max_connections=3, max_connections_per_client=2))
    assert tracker.admit("a") is None and tracker.admit("a") is None
    assert tracker.admit("a") == "max_connections_per_client"
    assert "this client (a) has 2 connections open" in tracker.refusal_message(
        "max_connections_per_client", "a"
    )
    assert tracker.admit("b") is None
    assert tracker.admit("c") == "max_connections"
    message = tracker.refusal_message("max_connections", "c")
    assert "3 connections open" in message and "--max-connections 3" in message
    tracker.release("a")
    assert tracker.admit("c") is None  # a closed connection freed its place
    tracker.timeout("body")
    stats = tracker.stats()
    assert stats.open == 3 and stats.max_connections == 3
    assert stats.refused == {"max_connections": 1, "max_connections_per_client": 1}
    assert stats.timed_out == {"head": 0, "body": 1}
    for client in ("a", "b", "c"):
        tracker.release(client)
    assert tracker.open == 0 and not tracker.by_client


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
