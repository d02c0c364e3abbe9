"""The structured section's server case (issue 30): what hostile schemas cost everyone else
on a real ``slotserve serve``. A plain streamed request's TTFT and ITL alone, then while 8
hostile ``response_format`` schemas (each an ``allOf`` of patterns, exponential to compile:
`slow_schema`) wait for and run in the bounded compile pool; ``/health``'s answer
time meanwhile; and how long SIGTERM takes to end the server with them still pending.

The plain request is a chat turn where the model has a chat template, else a completion.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import threading
import time
from typing import Any

import httpx

from slotserve.bench.processes import ServerProcess, slotserve_server
from slotserve.bench.stats import format_summary, summary
from slotserve.model import Model

# A schema of this many patterns never finishes compiling (it is stopped at a bound).
POOL_PATTERNS = 40
HOSTILE_REQUESTS = 8
PLAIN_TOKENS = 32
TARGET_RATIO = 1.5  # the issue's: TTFT and ITL within this factor of alone
SIGTERM_TARGET_S = 2.0


def slow_schema(variant: int, count: int) -> dict[str, Any]:
    """A schema of ``count`` patterns, slow to compile, distinct per ``variant``."""
    patterns = [{"pattern": f"[a-z]{{{i},}}"} for i in range(1, count + 1)]
    return {"type": "string", "allOf": patterns, "description": f"variant {variant}"}


def _body(model: Model, name: str, seed: int, **extra: Any) -> tuple[str, dict[str, Any]]:
    """The route and body of a greedy streamed request of `PLAIN_TOKENS` tokens."""
    fields = {"model": name, "max_tokens": PLAIN_TOKENS, "temperature": 0, **extra}
    text = f"Note {seed}: tell me about the harbour town."
    if model.tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        return "/v1/chat/completions", {**fields, "messages": messages}
    return "/v1/completions", {**fields, "prompt": text}


def _plain(server: ServerProcess, model: Model, name: str, seed: int) -> tuple[float, float]:
    """(TTFT ms, median ITL ms) of one streamed plain request."""
    route, body = _body(model, name, seed, stream=True, ignore_eos=True)
    times: list[float] = []
    client = server.http  # made before the clock starts
    sent = time.perf_counter()
    with client.stream("POST", route, json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta", {}).get("content") or choices[0].get("text")
            if delta:
                times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return (times[0] - sent) * 1000, statistics.median(gaps) * 1000


def _send_hostile(server: ServerProcess, model: Model, name: str, index: int) -> None:
    """One hostile request; whatever it ends with (400 past a bound, 429, the server's
    shutdown) is not what is measured."""
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "h", "schema": slow_schema(index, POOL_PATTERNS)},
    }
    route, body = _body(model, name, index, response_format=schema_format)
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(server.url + route, json=body, timeout=120)


def run_hostile_schemas(model: Model, repeats: int = 3) -> dict[str, Any]:
    """The figures above, each plain request ``repeats`` times alone and while hostile."""
    flags = ("--max-seqs", "4", "--max-context", str(min(512, model.info.max_context)))
    server = slotserve_server(model.source, *flags, "--kv-layout", "cell", "--no-web")
    senders: list[threading.Thread] = []
    try:
        name = server.model_name
        _plain(server, model, name, 0)  # warm-up, not counted
        alone = [_plain(server, model, name, seed) for seed in range(1, repeats + 1)]
        senders = [
            threading.Thread(target=_send_hostile, args=(server, model, name, i), daemon=True)
            for i in range(HOSTILE_REQUESTS)
        ]
        for sender in senders:
            sender.start()
        time.sleep(0.5)  # all sent; the first compiling
        hostile, health = [], []
        for seed in range(1, repeats + 1):
            hostile.append(_plain(server, model, name, seed))
            start = time.perf_counter()
            server.http.get("/health", timeout=30).raise_for_status()
            health.append((time.perf_counter() - start) * 1000)
        pending = sum(sender.is_alive() for sender in senders)
    finally:
        start = time.perf_counter()
        status = server.stop()
        sigterm_s = time.perf_counter() - start
        for sender in senders:
            sender.join(timeout=30)
    ttft = [h[0] / a[0] for a, h in zip(alone, hostile, strict=True)]
    itl = [h[1] / a[1] for a, h in zip(alone, hostile, strict=True)]
    return {
        "hostile_requests": HOSTILE_REQUESTS,
        "pending_at_end": pending,
        "plain_tokens": PLAIN_TOKENS,
        "ttft_ms_alone": summary([a[0] for a in alone]),
        "ttft_ms_hostile": summary([h[0] for h in hostile]),
        "itl_ms_alone": summary([a[1] for a in alone]),
        "itl_ms_hostile": summary([h[1] for h in hostile]),
        "ttft_ratio": summary(ttft),
        "itl_ratio": summary(itl),
        "health_ms_max": round(max(health), 1),
        "sigterm_s": round(sigterm_s, 2),
        "exit_status": status,
        "target_ratio": TARGET_RATIO,
        "sigterm_target_s": SIGTERM_TARGET_S,
    }


def hostile_section(r: dict[str, Any]) -> list[str]:
    """The markdown of `run_hostile_schemas`'s figures (a part of the structured section)."""
    ratios = max(r["ttft_ratio"]["median"], r["itl_ratio"]["median"])
    met = ratios <= r["target_ratio"] and r["sigterm_s"] <= r["sigterm_target_s"]
    return [
        "### structured: a plain request beside hostile schemas, at the server",
        "",
        f"A real `slotserve serve` (4 slots, cell layout, the default compile bounds: one "
        f"worker, 10 s, 32 MiB); a plain greedy streamed request of {r['plain_tokens']} "
        f"tokens alone, then while {r['hostile_requests']} hostile `response_format` schemas "
        f"wait for and run in the compile pool ({r['pending_at_end']} still pending at the "
        "end). Ratios are hostile ÷ alone per repeat.",
        "",
        f"TTFT {format_summary(r['ttft_ms_hostile'])} ms against "
        f"{format_summary(r['ttft_ms_alone'])} alone (**{format_summary(r['ttft_ratio'], 2)}×**); "
        f"ITL {format_summary(r['itl_ms_hostile'])} ms against "
        f"{format_summary(r['itl_ms_alone'])} (**{format_summary(r['itl_ratio'], 2)}×**); "
        "`/health` answered within "
        f"{r['health_ms_max']} ms; SIGTERM ended the server in {r['sigterm_s']} s (exit "
        f"{r['exit_status']}). Target: ratios ≤ {r['target_ratio']}×, SIGTERM ≤ "
        f"{r['sigterm_target_s']:g} s: {'met' if met else 'missed'}.",
        "",
    ]
