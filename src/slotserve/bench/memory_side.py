"""Scenario ``memory`` with ``--baselines``: slotserve's server and llama-server side by side
at the same slots × context on the same GGUF, the whole process's resident set of each.

Each server in turn, alone on the machine: started, read at ready, then sent ``SEQS``
distinct prompts of ``PROMPT_TOKENS`` token ids at once (``/v1/completions``, greedy,
``DECODE_TOKENS`` tokens each), read right after the last answer, and read again after a
pause of ``PAUSE_S`` (slotserve gives its freed activations back once idle for a second:
`slotserve.engine.engine.IDLE_TRIM_S`). The peak is the process's VmHWM over its life, the
load included. slotserve runs ``serve``'s defaults (fp16 KV, the prefix cache on) with the
cell layout; llama-server its own (f16 KV, which it allocates whole at start).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx

from slotserve.memory import read_process
from slotserve.model import Model

SEQS, CONTEXT = 4, 2048
PROMPT_TOKENS = 1500
DECODE_TOKENS = 64
PAUSE_S = 2.5


def run_side_by_side(
    model: Model,
    threads: int | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
    decode_tokens: int = DECODE_TOKENS,
) -> dict[str, Any]:
    """Both servers on ``model``'s GGUF (see the module docstring); ``{"skipped": why}``
    where llama-server is not built."""
    from slotserve.bench.llama_server import find_llama_server
    from slotserve.bench.processes import ServerProcess, llama_server, slotserve_server
    from slotserve.bench.servers import gguf_of
    from slotserve.native import process_cores

    binary = find_llama_server()
    if binary is None:
        return {"skipped": "llama-server is not built; `make bench-deps` builds it"}
    gguf = gguf_of(model, None)
    threads = threads or process_cores()
    vocab = model.info.vocab_size

    def start(name: str) -> ServerProcess:
        if name == "llama-server":
            return llama_server(
                binary, gguf, parallel=SEQS, threads=threads, context=SEQS * CONTEXT
            )
        flags = ("--max-seqs", str(SEQS), "--max-context", str(CONTEXT), "--kv-layout", "cell")
        return slotserve_server(str(gguf), *flags, "--no-web", "--threads", str(threads))

    servers = {}
    for name in ("slotserve", "llama-server"):
        server = start(name)
        try:
            servers[name] = _drive(server, vocab, prompt_tokens, decode_tokens)
        finally:
            server.stop()
    ratios = {
        key: servers["slotserve"][key] / servers["llama-server"][key]
        for key in (*RESIDENT_KEYS, *ANONYMOUS_KEYS)
    }
    return {
        "gguf": str(gguf),
        "threads": threads,
        "seqs": SEQS,
        "context": CONTEXT,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "pause_s": PAUSE_S,
        "servers": servers,
        "ratios": ratios,
    }


RESIDENT_KEYS = ("ready_bytes", "after_bytes", "paused_bytes", "peak_bytes")
# The anonymous (dirty) bytes: what a device's low-memory killer counts, and what slotserve's
# plan budgets; a mapped model file's clean pages are the kernel's to drop.
ANONYMOUS_KEYS = ("ready_anonymous_bytes", "after_anonymous_bytes", "paused_anonymous_bytes")


def _drive(server: Any, vocab: int, prompt_tokens: int, decode_tokens: int) -> dict[str, int]:
    pid = server.process.pid
    ready_reading = read_process(pid)
    ready = ready_reading.resident
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(SEQS)]
    failures: list[str] = []

    def one(prompt: list[int]) -> None:
        body = {
            "model": server.model_name,
            "prompt": prompt,
            "max_tokens": decode_tokens,
            "temperature": 0,
        }
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
        if reply.status_code != 200:
            failures.append(f"{reply.status_code}: {reply.text[:200]}")

    streams = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.join()
    if failures:
        raise RuntimeError(f"{server.url} refused a prompt: {failures[0]}")
    after_reading = read_process(pid)
    after = after_reading.resident
    time.sleep(PAUSE_S)
    paused = read_process(pid)
    return {
        "ready_bytes": ready,
        "after_bytes": after,
        "paused_bytes": paused.resident,
        # Linux updates VmHWM lazily: it may trail a VmRSS read before it.
        "peak_bytes": max(paused.peak, ready, after, paused.resident),
        "ready_anonymous_bytes": ready_reading.anonymous,
        "after_anonymous_bytes": after_reading.anonymous,
        "paused_anonymous_bytes": paused.anonymous,
    }
