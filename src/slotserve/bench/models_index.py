"""``bench models``, first part: a chat turn's inter-token latency while an embedding model
indexes passages in the background, with the chat model and the embedding model in one
slotserve process, in a slotserve process beside a llama-server one, and in two
llama-server processes.

Each setup's servers run with the same threads each (the cores this process may use), so
two processes are what a device gets when each plans as if it owned it. Each repeat, on
each setup in turn: the chat turn alone, the indexing job alone (texts per second), then
the job again with the turn sent once the job's first batch has come back. The turn is a
streamed completion of a `PROMPT_TOKENS`-token prompt, greedy, ``ignore_eos``, of class
``interactive``; the job posts its passages to ``/v1/embeddings`` in batches, two batches
in flight, of class ``background`` (the ``priority`` field, which llama-server ignores).
Alone, the job runs through the passages or for `INDEX_S` seconds; beside the turn, it
sends no batch after the turn's end. The turn's inter-token latency is its decode time over
its tokens (`Stream.mean_itl`: slotserve's server drafts n-grams by default and delivers
several tokens in some steps, so most gaps between chunks are nothing and their median is
no latency); the ratio is that beside the job over the same alone, per repeat, and the p90
of the gaps between chunks shows the longest waits. ``overlap`` is the share of turns that
ended while the job still had a batch in flight.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slotserve.bench.processes import ServerProcess, tree_memory
from slotserve.bench.servers import Stream, stream_completion
from slotserve.bench.stats import percentile, summary

CHAT_CONTEXT = 512  # per-slot context of the chat servers (prompt + turn fit with room)
EMBED_CONTEXT = 512  # llama-server's per-slot context for MiniLM (its position limit)
INDEX_CLIENTS = 2  # batches in flight: the embedder always has the next one queued
INDEX_S = 30.0  # how long the job alone runs at most (its rate is the figure, not its end)


@dataclass
class Endpoint:
    """Where a setup serves one of its two models: a base URL and the request's model."""

    url: str
    model: str


@dataclass
class Setup:
    """A way of serving the chat model and the embedding model: the servers (the processes
    whose trees are measured) and each model's endpoint."""

    name: str
    servers: list[ServerProcess]
    chat: Endpoint
    embed: Endpoint


@dataclass
class Indexing:
    """One indexing job as the client saw it."""

    began: float
    ended: float
    texts: int
    tokens: int

    @property
    def texts_per_s(self) -> float:
        return self.texts / (self.ended - self.began)


def index(
    embed: Endpoint,
    texts: list[str],
    batch: int,
    *,
    first_batch: threading.Event | None = None,
    stop: threading.Event | None = None,
    for_s: float | None = None,
    clients: int = INDEX_CLIENTS,
) -> Indexing:
    """Embed ``texts`` in batches of ``batch``, ``clients`` at a time, class
    ``background``; set ``first_batch`` once the first batch has come back. No batch is
    sent once ``stop`` is set or ``for_s`` seconds have passed (those in flight finish);
    the figures count the batches that came back."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    done: list[tuple[int, int]] = []  # (texts, tokens) of each batch back
    lock = threading.Lock()
    pending = iter(chunks)
    began = time.perf_counter()
    deadline = began + for_s if for_s is not None else None

    def worker(client: httpx.Client) -> None:
        while True:
            with lock:
                chunk = next(pending, None)
            late = deadline is not None and time.perf_counter() >= deadline
            if chunk is None or late or (stop is not None and stop.is_set()):
                return
            body = {"model": embed.model, "input": chunk, "priority": "background"}
            reply = client.post(embed.url + "/v1/embeddings", json=body, timeout=600)
            if reply.status_code != 200:
                raise RuntimeError(f"embeddings: {reply.status_code} {reply.text[:500]}")
            data = reply.json()
            if len(data["data"]) != len(chunk):
                raise RuntimeError(f"embeddings: {len(data['data'])} vectors, not {len(chunk)}")
            with lock:
                done.append((len(chunk), int(data.get("usage", {}).get("prompt_tokens", 0))))
            if first_batch is not None:
                first_batch.set()

    with httpx.Client() as client, ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker, client) for _ in range(clients)]:
            future.result()
    return Indexing(began, time.perf_counter(), sum(n for n, _ in done), sum(t for _, t in done))


def chat_turn(chat: Endpoint, prompt: list[int], tokens: int) -> Stream:
    """One streamed completion of class ``interactive`` (`stream_completion`)."""
    import openai

    client = openai.OpenAI(base_url=chat.url + "/v1", api_key="unused", max_retries=0)
    extra = {"priority": "interactive"}
    return stream_completion(client, chat.model, prompt, threading.Barrier(1), tokens, extra)


def turn_beside_job(
    setup: Setup, prompt: list[int], tokens: int, texts: list[str], batch: int
) -> tuple[Stream, Indexing]:
    """The chat turn sent once the indexing job's first batch is back, and the job, which
    sends no more batches once the turn has ended."""
    first_batch, stop = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(index, setup.embed, texts, batch, first_batch=first_batch, stop=stop)
        while not first_batch.wait(0.05):
            if job.done():  # failed, or so short that it ended before the first wait
                break
        try:
            turn = chat_turn(setup.chat, prompt, tokens)
        finally:
            stop.set()
        return turn, job.result()


def measure_setup(
    setup: Setup,
    prompts: list[list[int]],
    tokens: int,
    texts: list[str],
    batch: int,
    progress: Callable[[str], None],
    index_s: float = INDEX_S,
) -> dict[str, Any]:
    """`prompts[0]` warms up; each later prompt is one repeat (see the module docstring);
    the job alone runs through ``texts`` or for ``index_s`` seconds, whichever is first."""
    chat_turn(setup.chat, prompts[0], 4)
    index(setup.embed, texts[:batch], batch)
    alone_itl: list[float] = []
    with_itl: list[float] = []
    ratios: list[float] = []
    p90s: list[tuple[float, float]] = []
    alone_rate: list[float] = []
    with_rate: list[float] = []
    overlaps: list[bool] = []
    job_tokens: list[int] = []
    job_texts: list[int] = []
    for repeat, prompt in enumerate(prompts[1:], 1):
        progress(f"{setup.name}: repeat {repeat}, the chat turn alone")
        alone = chat_turn(setup.chat, prompt, tokens)
        progress(f"{setup.name}: repeat {repeat}, indexing alone (at most {index_s:g} s)")
        job = index(setup.embed, texts, batch, for_s=index_s)
        progress(f"{setup.name}: repeat {repeat}, the chat turn beside the indexing")
        beside, busy = turn_beside_job(setup, prompt, tokens, texts, batch)
        alone_mean, beside_mean = alone.mean_itl, beside.mean_itl
        alone_itl.append(alone_mean)
        with_itl.append(beside_mean)
        ratios.append(beside_mean / alone_mean)
        alone_rate.append(job.texts_per_s)
        with_rate.append(busy.texts_per_s)
        overlaps.append(beside.token_times[-1] <= busy.ended)
        job_tokens.append(job.tokens)
        job_texts.append(job.texts)
        p90 = (percentile(alone.itl, 90), percentile(beside.itl, 90))
        p90s.append(p90)
        progress(
            f"{setup.name}: ITL {alone_mean * 1000:.1f} ms alone, {beside_mean * 1000:.1f} ms "
            f"beside ({beside_mean / alone_mean:.2f}x; gaps' p90 {p90[0] * 1000:.1f} / "
            f"{p90[1] * 1000:.1f} ms); indexing {job.texts_per_s:.1f} texts/s alone, "
            f"{busy.texts_per_s:.1f} beside"
        )
    resident, anonymous = tree_memory([server.process.pid for server in setup.servers])
    return {
        "processes": len(setup.servers),
        "itl_ms_alone": summary([x * 1000 for x in alone_itl]),
        "itl_ms_beside": summary([x * 1000 for x in with_itl]),
        "itl_ratio": summary(ratios),
        "itl_p90_ms_alone": summary([a * 1000 for a, _ in p90s]),
        "itl_p90_ms_beside": summary([b * 1000 for _, b in p90s]),
        "index_texts_per_s_alone": summary(alone_rate),
        "index_texts_per_s_beside": summary(with_rate),
        "index_texts_alone": statistics.median(job_texts),
        "index_tokens_alone": statistics.median(job_tokens),
        "overlap": sum(overlaps) / len(overlaps),
        "resident_bytes": resident,
        "anonymous_bytes": anonymous,
    }


def keep(stack: ExitStack, server: ServerProcess) -> ServerProcess:
    """``server``, stopped when ``stack`` closes."""
    stack.callback(server.stop)
    return server


@dataclass(frozen=True)
class Servers:
    """How every setup starts its servers: the chat model (a spec for slotserve, a GGUF
    for llama-server, or None where it has none) with ``slots`` slots of ``context``
    tokens, the embedding model (a spec for slotserve, its GGUF for llama-server), the
    threads of each process, and ``batch`` texts a request. ``missing``: why a
    llama-server part is absent (``binary``, ``chat``, ``embed``)."""

    chat: str
    chat_gguf: Path | None
    embedder: str
    embed_gguf: Path | None
    binary: Path | None
    threads: int
    slots: int
    context: int
    batch: int
    missing: dict[str, str] = field(default_factory=dict)

    def slotserve_flags(self) -> tuple[str, ...]:
        return (
            *("--max-seqs", str(self.slots), "--max-context", str(self.context)),
            *("--threads", str(self.threads), "--no-web"),
        )

    def slotserve_chat(self, stack: ExitStack, *models: str) -> ServerProcess:
        """slotserve serving the chat model as ``chat``, beside ``models`` (``NAME=SPEC``)."""
        from slotserve.bench.processes import slotserve_server

        beside = [flag for model in models for flag in ("--model", model)]
        return keep(stack, slotserve_server(f"chat={self.chat}", *beside, *self.slotserve_flags()))

    def llama_chat(self, stack: ExitStack) -> ServerProcess:
        from slotserve.bench.processes import llama_server

        assert self.binary is not None and self.chat_gguf is not None
        slots, context = self.slots, self.slots * self.context
        server = llama_server(
            self.binary, self.chat_gguf, parallel=slots, threads=self.threads, context=context
        )
        return keep(stack, server)

    def llama_embed(self, stack: ExitStack) -> ServerProcess:
        """llama-server ``--embeddings``: a slot per text of a request, each of
        `EMBED_CONTEXT` tokens, one micro-batch as large (a non-causal model's text must
        fit one)."""
        from slotserve.bench.processes import llama_server

        assert self.binary is not None and self.embed_gguf is not None
        flags = ("--embeddings", "-b", str(EMBED_CONTEXT), "-ub", str(EMBED_CONTEXT))
        server = llama_server(
            self.binary,
            self.embed_gguf,
            *flags,
            parallel=self.batch,
            threads=self.threads,
            context=self.batch * EMBED_CONTEXT,
        )
        return keep(stack, server)


ONE_PROCESS = "slotserve, one process"
SLOTSERVE_BESIDE_LLAMA = "slotserve chat + llama-server embeddings"
TWO_LLAMA = "llama-server chat + llama-server embeddings"


def setups(servers: Servers) -> dict[str, Callable[[ExitStack], Setup] | str]:
    """Each setup's start, or the reason it cannot run: both models in one slotserve
    process; slotserve's chat beside llama-server's embeddings (slotserve serves an
    embedding model only beside a chat model); both on llama-server."""

    def one(stack: ExitStack) -> Setup:
        server = servers.slotserve_chat(stack, f"embed={servers.embedder}")
        chat, embed = Endpoint(server.url, "chat"), Endpoint(server.url, "embed")
        return Setup(ONE_PROCESS, [server], chat, embed)

    def beside(stack: ExitStack) -> Setup:
        chat_server = servers.slotserve_chat(stack)
        embed_server = servers.llama_embed(stack)
        chat = Endpoint(chat_server.url, "chat")
        embed = Endpoint(embed_server.url, embed_server.model_name)
        return Setup(SLOTSERVE_BESIDE_LLAMA, [chat_server, embed_server], chat, embed)

    def llama(stack: ExitStack) -> Setup:
        chat_server = servers.llama_chat(stack)
        embed_server = servers.llama_embed(stack)
        chat = Endpoint(chat_server.url, chat_server.model_name)
        embed = Endpoint(embed_server.url, embed_server.model_name)
        return Setup(TWO_LLAMA, [chat_server, embed_server], chat, embed)

    found: dict[str, Callable[[ExitStack], Setup] | str] = {ONE_PROCESS: one}
    missing = servers.missing
    no_binary, no_chat, no_embed = (missing.get(part) for part in ("binary", "chat", "embed"))
    found[SLOTSERVE_BESIDE_LLAMA] = no_binary or no_embed or beside
    found[TWO_LLAMA] = no_binary or no_chat or no_embed or llama
    return found
