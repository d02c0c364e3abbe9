"""Scenario ``servers``: slotserve's HTTP server against llama.cpp's ``llama-server``, side
by side, driven by one OpenAI client at 1, 2, 4 and 8 concurrent streams.

Both servers run at once on the same GGUF (for a bundle: the file it was exported from),
with a slot per stream of the highest level and the same threads, and take turns: each
repeat sends the same prompts to llama-server, then to slotserve, so every ratio compares
runs seconds apart. Requests are streamed completions on token-id prompts of exactly
`PROMPT_TOKENS` tokens of English text (no chat template, so both see the same tokens),
greedy, ``ignore_eos``, `DECODE_TOKENS` tokens. Every prompt opens with its own number, so
neither server's prompt cache answers for it. English keeps the continuation to about one
token per streamed chunk (a token that ends inside a UTF-8 character streams no text).

Figures are the client's: time to first token from sending the request, the gaps between
streamed tokens, and aggregate decode rate (tokens after each first, over the span from the
first first-token to the last token). Build llama-server with ``make bench-deps``.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress

from slotserve.bench.stats import (
    COMPARISON_COLUMNS,
    add_ratios,
    comparison_cells,
    markdown_table,
    side_figures,
)
from slotserve.memory import Reading, read_process
from slotserve.model import Model

LEVELS = (1, 2, 4, 8)
PROMPT_TOKENS = 32
DECODE_TOKENS = 128
SLOT_CONTEXT = 512  # per-slot context of both servers (prompt + decode fit with room)


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def itl(self) -> list[float]:
        """The gaps between chunks with text (a chunk may carry several tokens: a verified
        draft's)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def mean_itl(self) -> float:
        """Seconds per token after the first chunk: the decode's time over its tokens, which
        a server that delivers several tokens a step (speculation) cannot shrink to a
        chunk gap of nothing."""
        tokens = max(self.completion_tokens, len(self.token_times)) - 1
        return (self.token_times[-1] - self.token_times[0]) / max(tokens, 1)


def stream_completion(
    client: Any,
    model: str,
    prompt: list[int],
    start: threading.Barrier,
    tokens: int,
    extra: dict[str, Any] | None = None,
) -> Stream:
    """Send one streamed completion of ``tokens`` tokens once every stream of the round is
    ready; record when each chunk with text arrived and the usage's token count. ``extra``
    goes into the body beside ``ignore_eos`` (slotserve's ``priority``…)."""
    start.wait()
    stream = Stream(sent=time.perf_counter())
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **(extra or {})},
    )
    for chunk in response:
        if chunk.choices and chunk.choices[0].text:
            stream.token_times.append(time.perf_counter())
        if chunk.usage is not None:
            stream.completion_tokens = chunk.usage.completion_tokens
    if not stream.completion_tokens:  # a server that sends no usage: one chunk per token
        stream.completion_tokens = len(stream.token_times)
    return stream


def drive(
    client: Any, model: str, prompts: list[list[int]], tokens: int = DECODE_TOKENS
) -> list[Stream]:
    """All ``prompts`` at once, each on its own thread, ``tokens`` tokens each."""
    start = threading.Barrier(len(prompts))
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_completion, client, model, p, start, tokens) for p in prompts]
        return [f.result() for f in futures]


def aggregate_tok_s(streams: list[Stream]) -> float:
    begin = min(s.token_times[0] for s in streams)
    end = max(s.token_times[-1] for s in streams)
    return sum(s.completion_tokens - 1 for s in streams) / (end - begin)


PASSAGE = (
    "The harbour town woke before the sun. Fishing boats slid out past the lighthouse, "
    "bakers pulled the first loaves from their ovens, and the ferry to the island sounded "
    "its horn twice as the market stalls opened along the quay."
)


def numbered_prompts(model: Model, level: int, seed: int) -> list[list[int]]:
    """``level`` prompts of `PROMPT_TOKENS` tokens, each opening with its own number."""
    prompts = []
    for i in range(level):
        ids = model.tokenizer.encode(f"Note {seed}.{i}: {PASSAGE}")[:PROMPT_TOKENS]
        if len(ids) < PROMPT_TOKENS:
            raise ValueError(f"the bench passage is {len(ids)} tokens, under {PROMPT_TOKENS}")
        prompts.append(ids)
    return prompts


# A conversation's next turns: a shared 36-token history, then a 4-token user turn of its
# own, sent one after another (each server may reuse the history it computed: llama-server
# keeps each slot's prompt, slotserve's prefix cache its snapshots).
HISTORY_TOKENS, TURN_TOKENS, TURNS = 36, 4, 8


def _turns(model: Model) -> list[list[int]]:
    history = model.tokenizer.encode(f"Chat log. {PASSAGE}")[:HISTORY_TOKENS]
    turns = []
    for i in range(TURNS + 1):  # the first computes the history: a warm-up
        turn = model.tokenizer.encode(f" Question {i}: why?", add_bos=False)[:TURN_TOKENS]
        turns.append(history + turn)
    return turns


def repeated_prompt_ttft(client: Any, model: str, prompts: list[list[int]]) -> list[float]:
    """Each prompt's time to first token, sent one at a time (the first is a warm-up)."""
    times = []
    for prompt in prompts:
        done = stream_completion(client, model, prompt, threading.Barrier(1), 2)
        times.append(done.ttft)
    return times[1:]


def gguf_of(model: Model, reference: Model | None) -> Path:
    """The GGUF llama-server runs: the reference's, the model's own, or the bundle's source."""
    from slotserve.bench.executors import reference_of

    source = (reference or model).source
    if Path(source).suffix == ".gguf":
        return Path(source)
    if reference is None and model.weights is None:
        return Path(reference_of(model))
    raise ValueError(f"llama-server needs a .gguf model; {source} is not one (give --reference)")


def run_servers(
    model: Model,
    repeats: int = 3,
    reference: Model | None = None,
    threads: int | None = None,
    levels: tuple[int, ...] = LEVELS,
    decode_tokens: int = DECODE_TOKENS,
) -> dict[str, Any]:
    """``model`` (a GGUF or a bundle) on slotserve's server beside llama-server on its GGUF,
    at each number of concurrent streams in ``levels``."""
    import openai

    from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION, find_llama_server
    from slotserve.bench.processes import llama_server, slotserve_server
    from slotserve.native import process_cores

    binary = find_llama_server()
    if binary is None:
        return {"skipped": "llama-server is not built; `make bench-deps` builds it"}
    gguf = gguf_of(model, reference)
    threads = threads or process_cores()  # the kernels' threads (torch's may be 1: load())
    slots = max(levels)
    servers = {
        "llama-server": llama_server(
            binary, gguf, parallel=slots, threads=threads, context=slots * SLOT_CONTEXT
        ),
        "slotserve": slotserve_server(
            model.source,
            *("--max-seqs", str(slots), "--max-context", str(SLOT_CONTEXT)),
            *("--kv-layout", "cell", "--no-web", "--threads", str(threads)),
        ),
    }
    streams: dict[tuple[str, int], list[list[Stream]]] = {}
    readings: dict[str, Reading] = {}
    try:
        clients = {
            name: openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            for name, server in servers.items()
        }
        names = {name: server.model_name for name, server in servers.items()}
        with Progress(transient=True) as progress:
            task = progress.add_task("bench servers", total=len(levels) * repeats * len(servers))
            for level in levels:
                for repeat in range(repeats + 1):  # the first is a warm-up
                    prompts = numbered_prompts(model, level, seed=level * 1000 + repeat)
                    for name in servers:
                        done = drive(clients[name], names[name], prompts, decode_tokens)
                        if repeat:
                            streams.setdefault((name, level), []).append(done)
                            progress.advance(task)
        turns = _turns(model)
        repeated = {
            name: repeated_prompt_ttft(clients[name], names[name], turns) for name in servers
        }
        readings = {name: read_process(server.process.pid) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    return {
        "model": model.source,
        "gguf": str(gguf),
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "threads": threads,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": decode_tokens,
        "repeats": repeats,
        "rss_bytes": {name: reading.resident for name, reading in readings.items()},
        "anonymous_bytes": {name: reading.anonymous for name, reading in readings.items()},
        "rows": [_row(level, streams) for level in levels],
        "repeated_prompt_ttft_ms": {
            name: statistics.median(times) * 1000 for name, times in repeated.items()
        },
    }


def _row(level: int, streams: dict[tuple[str, int], list[list[Stream]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"streams": level}
    for name in ("llama-server", "slotserve"):
        rounds = streams[(name, level)]
        row[name] = side_figures(
            [aggregate_tok_s(done) for done in rounds],
            [s.ttft for done in rounds for s in done],
            [gap for done in rounds for s in done for gap in s.itl],
        )
    return add_ratios(row, "slotserve", "llama-server")


def servers_section(r: dict[str, Any]) -> list[str]:
    """The markdown section of `run_servers`'s result."""
    title = "## servers: slotserve's server vs llama.cpp's llama-server, one OpenAI client"
    if "skipped" in r:
        return [title, "", f"Skipped: {r['skipped']}.", ""]
    from slotserve.memory import format_bytes

    rss = {k: format_bytes(v) if v else "?" for k, v in r["rss_bytes"].items()}
    anonymous = {k: format_bytes(v) if v else "?" for k, v in r.get("anonymous_bytes", {}).items()}
    lines = [
        title,
        "",
        f"slotserve on `{r['model']}`, llama-server (llama.cpp from llama-cpp-python "
        f"{r['llama_cpp_python']}) on `{r['gguf']}`, {r['threads']} threads each, "
        f"{r['rows'][-1]['streams']} slots each, taking turns in one run: streamed "
        f"completions of {r['prompt_tokens']}-token prompts, {r['decode_tokens']} greedy "
        f"tokens (`ignore_eos`), {r['repeats']} repeats "
        f"after a warm-up. Ratios are slotserve ÷ llama-server. Server RSS at the end: "
        f"slotserve {rss['slotserve']}, llama-server {rss['llama-server']}; anonymous: "
        f"slotserve {anonymous.get('slotserve', '?')}, "
        f"llama-server {anonymous.get('llama-server', '?')}.",
        "",
    ]
    rows = [
        [str(x["streams"]), *comparison_cells(x, "slotserve", "llama-server")] for x in r["rows"]
    ]
    header = ["streams", "slotserve decode tok/s", "llama-server decode tok/s", *COMPARISON_COLUMNS]
    table = markdown_table(header, rows)
    if "repeated_prompt_ttft_ms" not in r:
        return lines + table
    ttft = r["repeated_prompt_ttft_ms"]
    return [
        *lines,
        *table,
        "",
        f"A repeated {HISTORY_TOKENS + TURN_TOKENS}-token prompt ({HISTORY_TOKENS} tokens of "
        f"shared history, then a {TURN_TOKENS}-token turn of its own, {TURNS} turns one at a "
        f"time): median TTFT slotserve {ttft['slotserve']:.1f} ms, llama-server "
        f"{ttft['llama-server']:.1f} ms ({ttft['slotserve'] / ttft['llama-server']:.2f}×).",
        "",
    ]
