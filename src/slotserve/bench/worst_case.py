"""Scenario ``memory``, its server half: a real ``slotserve serve`` driven to the worst case
its memory plan covers, and the server's peak anonymous bytes against the plan's total.

The plan is the server's own (the ``plan`` of its ``/dashboard/events`` snapshot: the
engine's process plan with the grammars arena). Once the server is ready its peak resident
set (Linux's VmHWM) is read, then reset (``5`` written to ``/proc/PID/clear_refs``), so
the peak reported is the serving process's, apart from the load's transient one, which is
reported beside it. The worst case, phase by phase, each read from ``/proc/PID/status`` (`PHASES`):

- ``serving``: a short plain chat turn and a short completion, then stored responses (the
  Responses API) until the store holds its byte budget or its count bound (`fill_responses`;
  none where the model cannot chat), then distinct prompts of
  half the context, ``max_seqs`` at a time, until the prefix cache's snapshots fill its
  budget (it evicts, or one more would not fit), then the first worst-case round: each of
  ``max_seqs`` streams sent together is a distinct prompt of ``max_context - decode``
  tokens and ``decode`` tokens (``ignore_eos``), so every session runs at ``max_context``
  and the concurrent prefill steps are the largest the engine takes (``max_batch_tokens``,
  one chunk a session), ending next to ``max_context``. Beside that round, from its start,
  structured requests (``response_format`` ``json_schema``), one distinct schema each: the
  first builds the grammar compiler's tokenizer index while the largest steps run (the
  plan counts both at once), and the grammars arena fills with as many as it keeps;
- ``worst case``: ``rounds`` more worst-case rounds, the prefix cache full again before
  each and the grammars held: the whole plan at once.

Everything is compared in anonymous bytes, what the plan counts: the kernel keeps no
anonymous peak, so a phase's is bounded by its resident peak less the file pages resident
when the phase began. Arenas are measured where the outside of the process can tell them
apart (`ARENA_ROWS`): the anonymous bytes at ready (the runtime, the tokenizer and the
weights), the peak of ``serving`` above it (the KV pool, whose pages become resident as
sessions write them, the prefix cache's copies and the activations, with whatever serving
costs once, and the grammar compiler's tokenizer index, which serve measures at start and
builds again at the first structured request, and the grammars), and the peak of the last
rounds above their start (which the plan has nothing more for). The
server's grammar worker processes (its children) are read apart, each its anonymous peak as
the server's start measured one (`slotserve.sampling.grammar_index`), and the whole peak is
the server's and theirs together.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from rich.progress import Progress

from slotserve.bench.processes import ServerProcess, children, slotserve_server
from slotserve.memory import read_process

DECODE_TOKENS = 8  # each worst-case stream's tokens after its prompt
GRAMMARS = 4  # distinct schemas the grammars phase sends
STRUCTURED_TOKENS = 16
# How many times a structured request the server's queue turned away (a 429) is sent again.
QUEUE_RETRIES = 8
PHASES = ("ready", "serving", "worst case")
# What `arena_rows` compares: a measured span of the server's resident set, and the arenas
# of the plan that span holds (``pool``: the KV pool alone, ``copies``: the kv arena less
# the pool, the prefix cache's copies).
ARENA_ROWS = (
    ("at ready", ("runtime", "tokenizer", "weights", "methods", "start")),
    (
        "serving with the grammars, its peak above ready",
        ("responses", "pool", "copies", "activations", "grammar_index", "grammars"),
    ),
    ("worst case again, its peak above its start", ()),
    ("grammar worker processes, their peak", ("grammar_workers",)),
)


def proc_status(pid: int) -> dict[str, int]:
    """The ``Vm*`` sizes of process ``pid`` in bytes (Linux ``/proc/PID/status``)."""
    sizes = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key.startswith("Vm") and value.strip().endswith("kB"):
                sizes[key] = int(value.split()[0]) * 1024
    return sizes


def reset_peak(pid: int) -> None:
    """Start process ``pid``'s VmHWM again from its current resident set."""
    with open(f"/proc/{pid}/clear_refs", "w") as handle:
        handle.write("5")


def dashboard_snapshot(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """One snapshot of the server's dashboard feed (`slotserve.server.ops.dashboard`)."""
    with httpx.stream("GET", url + "/dashboard/events?interval=5", timeout=timeout_s) as feed:
        for line in feed.iter_lines():
            if line.startswith("data: "):
                snapshot: dict[str, Any] = json.loads(line[len("data: ") :])
                if snapshot.get("type") == "snapshot":
                    return snapshot
    raise RuntimeError(f"{url}/dashboard/events ended without a snapshot")


class Prompts:
    """Distinct token-id prompts: seeded random ids of the model's vocabulary, above its
    first ids (where the special tokens are)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.low = min(64, vocab_size // 4)
        self.high = vocab_size - 1
        self.random = random.Random(seed)

    def take(self, length: int) -> list[int]:
        return [self.random.randint(self.low, self.high) for _ in range(length)]


class WorstCaseDriver:
    """Drives the server at ``server`` (pid, url, served model) through `PHASES`,
    recording its ``/proc`` sizes after each; ``advance(n)`` is told of each finished
    request. ``responses`` False leaves the stored responses out (a store's fill is a few
    hundred requests of a whole context each: the prefix cache serves their prefill where it
    holds a context's snapshot)."""

    def __init__(
        self,
        server: ServerProcess,
        vocab_size: int,
        *,
        decode_tokens: int = DECODE_TOKENS,
        grammars: int = GRAMMARS,
        responses: bool = True,
        advance: Callable[[str, int], None] = lambda phase, n: None,
    ) -> None:
        import openai

        self.server = server
        self.pid = server.process.pid
        self.model = server.model_name
        self.client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=1800
        )
        self.prompts = Prompts(vocab_size)
        self.decode_tokens = decode_tokens
        self.grammars = grammars
        self.fills_responses = responses  # False: the store is left empty
        self.chats = True  # until the model is found to have no chat template
        self.advance = advance
        snapshot = dashboard_snapshot(server.url)
        self.plan: dict[str, Any] = snapshot["plan"]
        self.max_seqs = int(self.plan["max_seqs"])
        self.max_context = int(self.plan["max_context"])
        self.phases: dict[str, dict[str, int]] = {}
        self.stored: dict[str, Any] = {}  # the stored responses' view once filled
        self.requests: dict[str, int] = {}

    # -- the phases ------------------------------------------------------------------

    def run(self, rounds: int = 1) -> dict[str, Any]:
        """Every phase in order, each with its own peak (VmHWM reset before it); the
        result `slotserve.bench.report` reports."""
        load = proc_status(self.pid)  # its VmHWM: the load's peak
        self._reset_peak()
        self._record("ready")
        prefix: dict[str, Any] = {}

        def serving() -> None:
            self.first_requests()
            self.stored = self.fill_responses()
            prefix.update(self.fill_prefix_cache())
            self.worst_case(beside=self.structured)

        self._phase("serving", serving)
        rounds_peak = []
        for _ in range(max(rounds, 1)):
            self._reset_peak()
            self.fill_prefix_cache()  # full again, as the first round found it
            self.worst_case()
            self._record("worst case")
            rounds_peak.append(self.phases["worst case"]["anonymous_peak"])
        self.phases["worst case"]["anonymous_peak"] = max(rounds_peak)
        return self._result(load, prefix, rounds_peak)

    def _phase(self, name: str, drive: Callable[[], object]) -> None:
        self._reset_peak()
        drive()
        self._record(name)

    def _reset_peak(self) -> None:
        """Start the server's VmHWM again, and keep the file pages resident then: the
        anonymous peak of what follows is bounded by the resident peak less them
        (`slotserve.memory.anonymous_peak_since`)."""
        reset_peak(self.pid)
        start = read_process(self.pid)
        self._file_at_reset = start.file + start.shared

    def first_requests(self) -> None:
        """A short plain chat turn and a short completion: what serving each costs once. A
        model with no chat template serves no chat (a 400 says so): its structured requests
        are then completions (`structured`)."""
        import openai

        try:
            self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": "Hello."}],
                max_tokens=4,
                temperature=0,
            )
        except openai.BadRequestError as exc:
            if "no chat template" not in str(exc):
                raise
            self.chats = False
        self._count("first request")
        self._together([self.prompts.take(8)], 4, "first request")

    def structured(self) -> None:
        """`GRAMMARS` structured requests, each with a schema of its own; one the server's
        queue turned away (a 429: every slot stayed busy past its queue timeout, as beside
        a slow worst-case round) is sent again, as a client would, `QUEUE_RETRIES` times."""
        import openai

        for i in range(self.grammars):
            for retry in range(QUEUE_RETRIES + 1):
                try:
                    self._structured(i)
                    break
                except openai.RateLimitError:
                    if retry == QUEUE_RETRIES:
                        raise
            self._count("grammars")

    def _structured(self, i: int) -> None:
        """The ``i``-th structured request."""
        schema = {
            "type": "object",
            "properties": {f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": [f"field_{i}"],
            "additionalProperties": False,
        }
        response_format: Any = {
            "type": "json_schema",
            "json_schema": {"name": f"record_{i}", "schema": schema},
        }
        text = f"A record, number {i}."
        if self.chats:
            self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": text}],
                max_tokens=STRUCTURED_TOKENS,
                temperature=0,
                response_format=response_format,
            )
        else:  # the server's completions take response_format too
            self.client.completions.create(
                model=self.model,
                prompt=text,
                max_tokens=STRUCTURED_TOKENS,
                temperature=0,
                extra_body={"response_format": response_format},
            )

    def fill_responses(self) -> dict[str, Any]:
        """Stored responses until the store holds its byte budget (within one response of
        it) or as many responses as it keeps: each a Responses request of one output token
        whose input is as many one-word user messages as the context holds (a message's
        dict and strings are most of what is stored, for a few tokens each), the same input
        each time, so that a prefix cache serves its prefill (a server on dense weights
        keeps none by default, and prefills each). The store's view after (from the
        dashboard feed), or ``{"left_empty": why}``."""
        if not self.fills_responses:
            return {"left_empty": "the driver was told to leave the store empty"}
        if not self.chats:
            return {"left_empty": "the model has no chat template"}
        view = self._responses_view()
        if view is None or not view["budget_bytes"] or not view["size"]:
            return {"left_empty": "the server keeps no stored responses"}
        messages = self._messages_filling(self.max_context - 16)
        body = {"model": self.model, "input": messages, "max_output_tokens": 1, "temperature": 0}
        batch, each = 1, 0  # requests before the next look at the store; bytes a response
        while True:
            before = view["held_bytes"], view["stored"]
            for _ in range(batch):
                answer = self.server.http.post("/v1/responses", json=body)
                answer.raise_for_status()
                self._count("responses")
            view = self._responses_view() or view
            if view["stored"] > before[1]:  # (the same input: every response the same size)
                each = (view["held_bytes"] - before[0]) // (view["stored"] - before[1])
            room = view["budget_bytes"] - view["held_bytes"]
            if view["stored"] >= view["size"] or each <= 0 or room < each:
                break
            # As many as the store still takes by either bound (a look costs a request's time).
            batch = min(view["size"] - view["stored"], room // each)
        return view

    def _messages_filling(self, tokens: int) -> list[dict[str, str]]:
        """One-word user messages, as many as fit in ``tokens`` tokens of the model's chat
        template (counted by the server's ``/tokenize``)."""

        def messages(count: int) -> list[dict[str, str]]:
            return [{"role": "user", "content": f"w{i}"} for i in range(count)]

        def used(count: int) -> int:
            body = {"messages": messages(count)}
            answer = self.server.http.post("/tokenize", json=body, timeout=60)
            answer.raise_for_status()
            return int(answer.json()["count"])

        count = max(tokens // 8, 1)
        count = max(count * tokens // used(count), 1)  # tokens grow by about one a message
        while count > 1 and used(count) > tokens:
            count -= max(count // 50, 1)
        return messages(count)

    def fill_prefix_cache(self) -> dict[str, Any]:
        """Distinct prompts of half the context, `max_seqs` at a time, until the prefix
        cache evicts or holds within one prompt's snapshot of its budget; its stats."""
        prefix = self._prefix_stats()
        if prefix is None or not prefix["budget_bytes"]:
            return {"off": True}
        length = max(self.max_context // 2, 1)
        per_token = self.plan["bytes_per_session"] / self.max_context
        snapshot = length * per_token
        batches = int(prefix["budget_bytes"] // max(snapshot * self.max_seqs, 1)) + 3
        for _ in range(batches):
            prompts = [self.prompts.take(length) for _ in range(self.max_seqs)]
            self._together(prompts, 1, "prefix")
            prefix = self._prefix_stats() or prefix
            if prefix["evictions"] or prefix["bytes_pinned"] + snapshot > prefix["budget_bytes"]:
                break
        return dict(prefix)

    def worst_case(self, beside: Callable[[], object] | None = None) -> None:
        """`max_seqs` streams at once, each filling the context (``ignore_eos``); with
        ``beside``, that too, on a thread of its own from the same start."""
        length = self.max_context - self.decode_tokens
        prompts = [self.prompts.take(length) for _ in range(self.max_seqs)]
        self._together(prompts, self.decode_tokens, "worst case", beside)

    # -- helpers ---------------------------------------------------------------------

    def _together(
        self,
        prompts: Sequence[list[int]],
        tokens: int,
        phase: str,
        beside: Callable[[], object] | None = None,
    ) -> None:
        """Stream ``prompts`` at once (a barrier), ``tokens`` each, greedy, ignore_eos;
        ``beside`` run from the same barrier, on a thread of its own."""
        start = threading.Barrier(len(prompts) + (beside is not None))

        def one(prompt: list[int]) -> int:
            start.wait()
            stream = self.client.completions.create(
                model=self.model,
                prompt=prompt,
                max_tokens=tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            done = 0
            for chunk in stream:
                if chunk.usage is not None:
                    done = chunk.usage.completion_tokens
            self._count(phase)
            return done

        def aside() -> None:
            assert beside is not None
            start.wait()
            beside()

        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            side = pool.submit(aside) if beside is not None else None
            produced = list(pool.map(one, prompts))
            if side is not None:
                side.result()
        if produced != [tokens] * len(prompts):
            raise RuntimeError(f"{phase}: the streams produced {produced} tokens, not {tokens}")

    def _responses_view(self) -> dict[str, int] | None:
        view: dict[str, int] | None = dashboard_snapshot(self.server.url).get("responses")
        return view

    def _prefix_stats(self) -> dict[str, Any] | None:
        prefix: dict[str, Any] | None = dashboard_snapshot(self.server.url)["stats"]["prefix"]
        return prefix

    def _count(self, phase: str) -> None:
        self.requests[phase] = self.requests.get(phase, 0) + 1
        self.advance(phase, 1)

    def _record(self, phase: str) -> None:
        now = read_process(self.pid)
        self.phases[phase] = {
            "VmRSS": now.resident,
            "VmHWM": now.peak,
            "anonymous": now.anonymous,
            "anonymous_peak": max(now.peak - self._file_at_reset, now.anonymous),
            "children_anonymous_peak": sum(_anonymous_peak(c) for c in children(self.pid)),
        }

    def _result(
        self, load: dict[str, int], prefix: dict[str, Any], rounds_peak: list[int]
    ) -> dict[str, Any]:
        arenas: dict[str, int] = self.plan["arenas"]
        total = int(self.plan["worst_case_bytes"])
        peak = max(p["anonymous_peak"] + p["children_anonymous_peak"] for p in self.phases.values())
        return {
            "plan": {
                "arenas": arenas,
                "worst_case_bytes": total,
                "max_seqs": self.max_seqs,
                "max_context": self.max_context,
                "layout": self.plan["layout"],
                "kv_dtype": self.plan["kv_dtype"],
                "kv_pool_bytes": self.plan.get("kv_pool_bytes"),
            },
            "load_peak_rss_bytes": load["VmHWM"],
            "phases": self.phases,
            "rounds_peak_anonymous_bytes": rounds_peak,
            "peak_anonymous_bytes": peak,
            "peak_rss_bytes": max(p["VmHWM"] for p in self.phases.values()),
            "peak_over_plan": peak / total,
            "arena_rows": arena_rows(self.plan, self.phases),
            "prefix": prefix,
            "responses": self.stored,
            "requests": self.requests,
            "decode_tokens": self.decode_tokens,
        }


def arena_rows(plan: dict[str, Any], phases: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """`ARENA_ROWS`, each with its measured and planned bytes (see the module docstring)."""
    arenas: dict[str, int] = plan["arenas"]
    pool = int(plan.get("kv_pool_bytes") or arenas.get("kv", 0))
    parts = {**arenas, "pool": pool, "copies": arenas.get("kv", 0) - pool}
    rss = {name: phases[name]["anonymous"] for name in PHASES}
    peak = {name: phases[name]["anonymous_peak"] for name in PHASES}
    measured = [
        rss["ready"],
        peak["serving"] - rss["ready"],
        peak["worst case"] - rss["serving"],
        max(phases[name]["children_anonymous_peak"] for name in PHASES),
    ]
    return [
        {
            "span": span,
            "arenas": [a for a in names if parts.get(a)],
            "planned_bytes": sum(parts.get(a, 0) for a in names),
            "measured_bytes": got,
        }
        for (span, names), got in zip(ARENA_ROWS, measured, strict=True)
    ]


def _anonymous_peak(pid: int) -> int:
    """Process ``pid``'s anonymous peak: its resident peak less its file pages now (0 if
    it has ended)."""
    try:
        now = read_process(pid)
    except OSError:
        return 0
    return max(now.peak - now.file - now.shared, now.anonymous)


def run_worst_case(
    model_source: str,
    vocab_size: int,
    flags: Sequence[str],
    rounds: int = 1,
    decode_tokens: int = DECODE_TOKENS,
    grammars: int = GRAMMARS,
    responses: bool = True,
) -> dict[str, Any]:
    """``slotserve serve --model MODEL_SOURCE FLAGS…`` driven to its worst case ``rounds``
    times (see the module docstring); the figures, and the flags. ``vocab_size``: the
    model's, for the prompts' token ids; ``responses``: `WorstCaseDriver`'s."""
    server = slotserve_server(model_source, *flags)
    try:
        seqs = int(dashboard_snapshot(server.url)["plan"]["max_seqs"])
        totals = {
            "first request": 2,
            "prefix": 0,
            "worst case": seqs * (1 + max(rounds, 1)),
            "grammars": grammars,
            "responses": 0,
        }
        with Progress(transient=True) as progress:
            tasks = {
                name: progress.add_task(f"bench memory: {name}", total=n or None)
                for name, n in totals.items()
            }
            driver = WorstCaseDriver(
                server,
                vocab_size,
                decode_tokens=decode_tokens,
                grammars=grammars,
                responses=responses,
                advance=lambda phase, n: progress.advance(tasks[phase], n),
            )
            result = driver.run(rounds)
    finally:
        status = server.stop()
    if status != 0:
        raise RuntimeError(f"the server exited with status {status}: {server.output()[-2000:]}")
    return {"model": model_source, "flags": list(flags), "rounds": rounds, **result}
