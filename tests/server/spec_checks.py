"""Judging real server output by OpenAI's spec subset (``tests/data/openai-openapi-subset.yaml``):
a component schema as a JSON Schema validator, each Responses stream event by the schema its
``type`` names, and server-sent events read off the wire."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import schemathesis
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).parents[1] / "data" / "openai-openapi-subset.yaml"
SPEC_URI = "urn:openai-openapi-subset"
STREAM_EVENT = "ResponseStreamEvent"


@dataclass(frozen=True)
class Spec:
    """The subset document, with validators for its components."""

    document: dict[str, Any]

    @classmethod
    def load(cls) -> Spec:
        loaded = schemathesis.openapi.from_path(SPEC, config=schemathesis.Config())
        return cls(with_nullable(loaded.raw_schema))

    def validator(self, component: str) -> jsonschema.Draft202012Validator:
        """A JSON Schema 2020-12 validator (OpenAPI 3.1's dialect) for ``component``, its
        ``$ref`` targets resolved in the document."""
        if component not in self.document["components"]["schemas"]:
            raise LookupError(f"{component} is not in {SPEC.name}")
        resource = Resource.from_contents(self.document, default_specification=DRAFT202012)
        registry: Registry[Any] = Registry().with_resource(SPEC_URI, resource)
        ref = {"$ref": f"{SPEC_URI}#/components/schemas/{component}"}
        return jsonschema.Draft202012Validator(
            ref, registry=registry, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )

    def event_components(self) -> dict[str, str]:
        """Each Responses stream event ``type`` -> the component that defines that event."""
        schemas = self.document["components"]["schemas"]
        kinds: dict[str, str] = {}
        for option in schemas[STREAM_EVENT]["anyOf"]:
            name = option["$ref"].rsplit("/", 1)[1]
            for kind in schemas[name]["properties"]["type"]["enum"]:
                kinds[kind] = name
        return kinds


def with_nullable(node: Any) -> Any:
    """``node`` with OpenAPI 3.0's ``nullable: true`` (which OpenAI's 3.1 document still uses
    in places, and JSON Schema ignores) read as schemathesis reads it: null is allowed too."""
    if isinstance(node, list):
        return [with_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    rewritten = {k: with_nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [rewritten, {"type": "null"}]}
    return rewritten


def errors(validator: jsonschema.Draft202012Validator, instance: Any) -> list[str]:
    """Every violation of ``instance``, each as ``path: message`` (empty when it conforms)."""
    found = validator.iter_errors(instance)
    return [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in found]


class EventJudge:
    """Validates Responses stream events, each by the spec component its ``type`` names."""

    def __init__(self, spec: Spec) -> None:
        self.components = spec.event_components()
        self.validators = {name: spec.validator(name) for name in set(self.components.values())}

    def problems(self, event: dict[str, Any]) -> list[str]:
        kind = event.get("type")
        component = self.components.get(kind) if isinstance(kind, str) else None
        if component is None:
            return [f"event type {kind!r} is not a {STREAM_EVENT} in the spec"]
        return [f"{kind}: {e}" for e in errors(self.validators[component], event)]


@dataclass(frozen=True)
class SSE:
    """One server-sent event: its ``event:`` name (None without one) and its ``data``."""

    event: str | None
    data: str


def sse_events(lines: Iterator[str]) -> Iterator[SSE]:
    """The events of a ``text/event-stream`` body (one ``data:`` line each, as the server
    writes them); comments are skipped."""
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield SSE(name, "\n".join(data))
            name, data = None, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    if data:
        yield SSE(name, "\n".join(data))


def stream_post(url: str, body: dict[str, Any], timeout: float = 60) -> list[SSE]:
    """POST ``body`` with ``stream: true`` to ``url``; the events of its 200 event stream."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout) as answer:
        if answer.status_code != 200:
            answer.read()
            raise AssertionError(f"{answer.status_code}: {answer.text}")
        content_type = answer.headers["content-type"]
        assert content_type.startswith("text/event-stream"), content_type
        return list(sse_events(answer.iter_lines()))


def json_events(events: list[SSE]) -> list[dict[str, Any]]:
    """The JSON payloads of ``events``; each event's name must equal its payload's ``type``."""
    payloads: list[dict[str, Any]] = []
    for event in events:
        payload = json.loads(event.data)
        assert isinstance(payload, dict), event
        assert event.event is None or event.event == payload.get("type"), event
        payloads.append(payload)
    return payloads
