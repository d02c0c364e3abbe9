"""Issue 30, items 1-3: a hostile JSON schema cannot hang or bloat the server. Compiles run
in a worker process killed past ``--grammar-timeout`` or ``--grammar-max-bytes`` (400
naming the schema's path and the bound), one at a time by default, behind a queue
deadline, at the lowest CPU priority; a client that disconnects cancels its compile, and
SIGTERM never waits for one. The grammar cache is bounded in bytes and counted in the plan.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotserve.cli import serve as serve_cli
from slotserve.engine import Engine, EngineConfig
from slotserve.errors import PlanError
from slotserve.info import ModelInfo
from slotserve.kv.config import KVConfig
from slotserve.memory import MemoryLedger, rss_bytes
from slotserve.model import Model
from slotserve.plan import CapacityPlan
from slotserve.sampling.compile_pool import WORKER_SCRIPT, Worker
from slotserve.sampling.grammar import (
    CompileJob,
    GrammarBusy,
    GrammarCancelled,
    GrammarCompiler,
    GrammarConfig,
    GrammarLimitError,
)
from slotserve.server.chat.structured import SCHEMA_PARAM, GrammarCache
from slotserve.server.chat.tools import plan_tools, tool_grammar
from slotserve.server.http.errors import APIError
from slotserve.server.openai.schemas import ChatCompletionRequest
from slotserve.testing import tiny_model
from tests.server.conftest import ServerProcess

MIB = 2**20


def hostile(n: int = 40) -> dict[str, Any]:
    """The probe's schema: an allOf of n patterns, exponential in n to compile (n = 24
    took 97 s and 1.5 GB; n = 40 never ends), whatever llguidance's own limits."""
    return {"type": "string", "allOf": [{"pattern": f"[a-z]{{{i},}}"} for i in range(1, n + 1)]}


def wide(i: int, n: int = 400) -> dict[str, Any]:
    """A large schema that compiles (~1 MiB of grammar), distinct for each i."""
    props = {f"k{i}_{j}": {"type": "string", "maxLength": 5 + j % 7} for j in range(n)}
    return {"type": "object", "properties": props, "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def compiler_for(model: Model, **config: Any) -> GrammarCompiler:
    return GrammarCompiler(model.tokenizer, model.info.vocab_size, GrammarConfig(**config))


@pytest.fixture
def compilers(model: Model) -> Iterator[list[GrammarCompiler]]:
    """Compilers a test makes; their pools are closed after it."""
    made: list[GrammarCompiler] = []
    yield made
    for compiler in made:
        compiler.close()


def new_compiler(compilers: list[GrammarCompiler], model: Model, **config: Any) -> GrammarCompiler:
    compiler = compiler_for(model, **config)
    compilers.append(compiler)
    return compiler


def worker_pids(compiler: GrammarCompiler) -> list[int]:
    pool = compiler._pool
    assert pool is not None
    return [w.process.pid for w in pool.workers if w is not None and w.alive]


def wait_worker(compiler: GrammarCompiler, timeout_s: float = 30.0) -> list[int]:
    """The pool's live workers' pids, once it has one: a job is running from when its slot
    takes it, before the slot's worker process has started (an import and a handshake)."""
    deadline = time.monotonic() + timeout_s
    while not (pids := worker_pids(compiler)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids


def wait_running(job: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not job.future.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.future.running()


# --- item 1: bounded, cancellable compiles ---------------------------------------------


def test_a_hostile_schema_stops_at_the_time_bound(
    compilers: list[GrammarCompiler], model: Model
) -> None:
    compiler = new_compiler(
        compilers, model, timeout_s=1.0, max_bytes=4096 * MIB, cache_bytes=4096 * MIB
    )
    start = time.monotonic()
    with pytest.raises(GrammarLimitError, match=r"--grammar-timeout 1 s") as info:
        compiler.submit(hostile()).result()
    assert info.value.limit == "timeout" and info.value.bound == 1.0
    assert time.monotonic() - start < 6  # the worker's start, then 1 s of compiling
    assert compiler.submit({"type": "integer"}).result() is not None  # a fresh worker


def test_a_hostile_schema_stops_at_the_memory_bound(
    compilers: list[GrammarCompiler], model: Model
) -> None:
    compiler = new_compiler(
        compilers, model, timeout_s=120.0, max_bytes=8 * MIB, cache_bytes=8 * MIB
    )
    with pytest.raises(GrammarLimitError, match=r"--grammar-max-bytes 8 MiB") as info:
        compiler.submit(hostile()).result()
    assert info.value.limit == "memory" and info.value.bound == 8 * MIB


def test_cancel_kills_the_compile_and_close_waits_for_none(
    compilers: list[GrammarCompiler], model: Model
) -> None:
    compiler = new_compiler(
        compilers, model, timeout_s=120.0, max_bytes=4096 * MIB, cache_bytes=4096 * MIB
    )
    job = compiler.submit(hostile())
    wait_running(job)
    (pid,) = wait_worker(compiler)
    time.sleep(0.3)  # the worker has the schema and compiles
    job.cancel()
    with pytest.raises(GrammarCancelled):
        job.future.result(timeout=2)
    assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    running = compiler.submit(hostile(41))
    wait_running(running)
    start = time.monotonic()
    compiler.close()
    assert time.monotonic() - start < 2.0  # close never waits for the (120 s) compile
    with pytest.raises(GrammarCancelled):
        running.future.result(timeout=2)


def test_a_worker_killed_before_it_has_the_schema_is_a_cancelled_compile(
    compilers: list[GrammarCompiler], model: Model
) -> None:
    """close() may kill a worker between taking a job and sending it the schema: the write
    then meets a broken pipe, which is the cancellation, not an OSError for the waiter (CI
    once got BrokenPipeError from ``running.future`` in the test above)."""
    compiler = new_compiler(compilers, model)
    worker = Worker(compiler.worker_source())
    worker.kill()
    job = CompileJob(json.dumps({"type": "string"}), 1.0)
    with pytest.raises(OSError):  # not cancelled: the broken pipe is an error
        worker.compile(job, compiler.config)
    job.cancel()
    with pytest.raises(GrammarCancelled):
        worker.compile(job, compiler.config)
    worker.dispose()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


# --- item 2: one compile at a time, behind a deadline, at the lowest priority ----------


def test_compiles_queue_behind_a_deadline_at_the_lowest_priority(
    compilers: list[GrammarCompiler], model: Model
) -> None:
    compiler = new_compiler(
        compilers,
        model,
        timeout_s=3.0,
        queue_timeout_s=0.5,
        max_bytes=4096 * MIB,
        cache_bytes=4096 * MIB,
    )
    slow = compiler.submit(hostile())
    wait_running(slow)
    queued = compiler.submit({"type": "integer"})
    start = time.monotonic()
    with pytest.raises(GrammarBusy, match=r"--grammar-queue-timeout 0.5 s"):
        queued.result()
    assert 0.4 < time.monotonic() - start < 1.5  # behind the one worker, not beside it
    pool = compiler._pool
    assert pool is not None and len(pool.threads) == 1
    (pid,) = worker_pids(compiler)
    assert int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[16]) == 19
    native = pool.threads[0].native_id
    assert native is not None and os.getpriority(os.PRIO_PROCESS, native) == 19
    with pytest.raises(GrammarLimitError):
        slow.result()
    assert compiler.submit({"type": "integer"}).result() is not None


def test_config_errors_name_the_value_the_limit_and_the_flag() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0 .*--grammar-timeout"):
        GrammarConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"max_bytes=1024 .*4194304.*--grammar-max-bytes"):
        GrammarConfig(max_bytes=1024)
    with pytest.raises(ValueError, match=r"cache_bytes=.* below max_bytes.*--grammar-cache-bytes"):
        GrammarConfig(max_bytes=64 * MIB, cache_bytes=32 * MIB)
    with pytest.raises(ValueError, match=r"workers=0 .*--grammar-workers"):
        GrammarConfig(workers=0)


def test_the_cli_defaults_are_the_configs() -> None:
    parser = argparse.ArgumentParser()
    serve_cli.add_grammar_args(parser)
    assert serve_cli.grammar_config(parser.parse_args([])) == GrammarConfig()


# --- item 3: the cache in bytes, in the plan --------------------------------------------


def test_the_cache_is_bounded_in_bytes_counting_grammars_in_use(model: Model) -> None:
    config = GrammarConfig(max_bytes=8 * MIB, cache_bytes=16 * MIB)
    cache = GrammarCache(model, config=config)
    try:
        in_use = [cache.get(wide(i)) for i in range(4)]  # each ~3.2 MiB charged
        assert all(5 * MIB > g.nbytes > config.lexer_bytes for g in in_use)
        assert cache.live_bytes <= config.cache_bytes
        # Evicting the cached copies frees nothing while requests hold them: refused.
        with pytest.raises(GrammarBusy, match="--grammar-cache-bytes 16 MiB"):
            cache.get(wide(4))
        assert cache.cached == 0 and cache.live_bytes == sum(g.nbytes for g in in_use)
        del in_use
        gc.collect()
        assert cache.live_bytes == 0
        before = rss_bytes()
        for i in range(5, 205):
            cache.get(wide(i))
            assert cache.live_bytes <= config.cache_bytes
        # 200 distinct large schemas (issue 30's count): RSS stays within the arena (the
        # old cache kept 32 whatever their size).
        assert rss_bytes() - before < config.cache_bytes
    finally:
        cache.close()


def test_a_refused_schema_is_refused_again_without_a_compile(model: Model) -> None:
    cache = GrammarCache(model, config=GrammarConfig(timeout_s=0.5))
    try:
        with pytest.raises(GrammarLimitError):
            cache.get(hostile())
        start = time.monotonic()
        with pytest.raises(GrammarLimitError):
            cache.get(hostile())
        assert time.monotonic() - start < 0.05
    finally:
        cache.close()


def tool_body(*schemas: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request that must call one of functions f0, f1, ... taking ``schemas``."""
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
        for i, schema in enumerate(schemas)
    ]
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": tools, "tool_choice": "required"}
    )


def test_a_replys_tool_call_grammar_is_compiled_bounded_and_counted(model: Model) -> None:
    """The grammar holding every call is compiled in the bounded pool and charged in the
    cache, like each function's schema: six ~3 MiB functions each fit one grammar's 8 MiB,
    and the reply that may call any of them does not (before, it compiled in the server's
    own process, unbounded and uncounted)."""
    config = GrammarConfig(max_bytes=8 * MIB, cache_bytes=64 * MIB)
    cache = GrammarCache(model, config=config)
    try:
        plan = plan_tools(model.tokenizer, tool_body(wide(0)))
        assert plan is not None
        grammar = asyncio.run(tool_grammar(cache, plan, model.tokenizer))
        assert cache.cached == 2  # the function's schema and the reply's grammar
        assert grammar.nbytes > config.lexer_bytes
        assert cache.live_bytes >= grammar.nbytes + config.lexer_bytes
        assert asyncio.run(tool_grammar(cache, plan, model.tokenizer)) is grammar
        plan = plan_tools(model.tokenizer, tool_body(*(wide(i) for i in range(6))))
        assert plan is not None
        with pytest.raises(APIError) as info:
            asyncio.run(tool_grammar(cache, plan, model.tokenizer))
        error = info.value
        assert (error.status, error.param, error.code) == (400, "tools", "schema_too_complex")
        assert "--grammar-max-bytes 8 MiB" in str(error.message)
    finally:
        cache.close()


class GoneClient:
    """The part of a Starlette request the compile's wait reads: a client that went away
    ``after`` seconds in (a real server's disconnect is tested above, for response_format;
    a tool's prompt renders its whole schema, too long for the tiny model's context)."""

    def __init__(self, after: float) -> None:
        self.gone_at = time.monotonic() + after
        self.app = argparse.Namespace(state=argparse.Namespace())

    async def is_disconnected(self) -> bool:
        return time.monotonic() > self.gone_at


def test_a_tool_schemas_compile_is_cancelled_when_its_client_goes(model: Model) -> None:
    """Before, a tool's schema compiled in a thread nothing cancelled, on to its bound."""
    config = GrammarConfig(timeout_s=30.0, max_bytes=4096 * MIB, cache_bytes=4096 * MIB)
    cache = GrammarCache(model, config=config)
    hostile_object = {"type": "object", "properties": {"x": hostile(42)}, "required": ["x"]}
    try:
        plan = plan_tools(model.tokenizer, tool_body(hostile_object))
        assert plan is not None
        start = time.monotonic()
        with pytest.raises(APIError) as info:
            request: Any = GoneClient(after=1.0)
            asyncio.run(tool_grammar(cache, plan, model.tokenizer, request))
        assert info.value.status == 499
        assert time.monotonic() - start < 3
        pool = cache.compiler._pool
        assert pool is not None
        deadline = time.monotonic() + 2
        while any(w is not None and w.alive for w in pool.workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(w is not None and w.alive for w in pool.workers)  # its worker killed
    finally:
        cache.close()


INFO = ModelInfo(
    "llama", vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
    ffn_dim=128, max_context=256,
)  # fmt: skip


def test_the_plan_counts_the_grammars_arena() -> None:
    kv = KVConfig(layout="cell", max_seqs=2, max_context=256, block_size=16)
    held = MemoryLedger()
    held.add("weights", 1000, "computed", "the test")
    plain = CapacityPlan(INFO, kv, held)
    assert "grammars" not in plain.arenas
    worst = plain.worst_case_bytes
    held.add("grammars", 128 * MIB, "computed", "--grammar-cache-bytes")
    plan = CapacityPlan(INFO, kv, held, memory_budget=worst + 64 * MIB)
    assert plan.arenas["grammars"] == 128 * MIB
    assert plan.worst_case_bytes == worst + 128 * MIB
    assert not plan.fits
    with pytest.raises(PlanError, match=r"grammars 128.00 MiB.*--grammar-cache-bytes"):
        plan.check()


def test_serve_counts_the_grammar_cache_in_the_engines_plan(model: Model) -> None:
    engine = Engine(model, EngineConfig(max_seqs=2, max_context=64))
    try:
        worst = engine.plan.worst_case_bytes
        serve_cli.add_server_arenas(engine.ledger, "model", 32 * MIB)
        engine.plan.check()
        assert engine.plan.arenas["grammars"] == 32 * MIB
        assert engine.plan.worst_case_bytes == worst + 32 * MIB
    finally:
        engine.close()
    tight = EngineConfig(max_seqs=2, max_context=64, memory_budget=worst + MIB)
    engine = Engine(model, tight)
    try:
        serve_cli.add_server_arenas(engine.ledger, "model", 32 * MIB)
        with pytest.raises(PlanError, match="--grammar-cache-bytes"):
            engine.plan.check()
    finally:
        engine.close()


# --- the server -------------------------------------------------------------------------

TEMPLATE = (
    "{% if messages[0]['content'] == 'refuse' %}{{ raise_exception('no refusals here') }}"
    "{% endif %}{% if messages[0]['content'] == 'boom' %}{% for m in true %}{% endfor %}"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def server(
    tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ["--max-seqs", "4", "--max-context", "256", "--grammar-timeout", "3"]
    flags += ["--grammar-max-bytes", "4GiB", "--grammar-cache-bytes", "4GiB"]
    process = ServerProcess(str(tiny_dirs["llama"]), *flags, "--chat-template", str(template))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


def chat(server: ServerProcess, content: str = "hi", **body: Any) -> dict[str, Any]:
    return {
        "model": server.model_name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        **body,
    }


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def test_a_hostile_schema_is_400_naming_the_path_and_the_bound(server: ServerProcess) -> None:
    """Before issue 30 this request never returned and the server's RSS kept growing."""
    body = chat(server, response_format=schema_format(hostile()))
    start = time.monotonic()
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == SCHEMA_PARAM and error["code"] == "schema_too_complex"
    assert error["message"].startswith(SCHEMA_PARAM + ": ")
    assert "--grammar-timeout 3 s" in error["message"]
    assert time.monotonic() - start < 10


def server_workers(pid: int) -> list[int]:
    """The server's grammar workers: its children running `WORKER_SCRIPT`."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as handle:
            children += [int(c) for c in handle.read().split()]
    return [c for c in children if str(WORKER_SCRIPT).encode() in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_client_that_disconnects_cancels_its_compile(server: ServerProcess) -> None:
    """The compile is stopped when its client goes, long before its 3 s bound."""
    body = chat(server, response_format=schema_format(hostile(42)))
    url = server.url + "/v1/chat/completions"
    outcomes: list[BaseException] = []

    def leave_early() -> None:
        try:
            httpx.post(url, json=body, timeout=0.5)
        except httpx.ReadTimeout as exc:
            outcomes.append(exc)

    client = threading.Thread(target=leave_early)
    start = time.monotonic()
    client.start()
    worker = None
    while worker is None and time.monotonic() - start < 5:
        found = server_workers(server.process.pid)
        worker = found[0] if found else None
        time.sleep(0.02)
    assert worker is not None
    client.join()
    assert outcomes  # the client gave up, unanswered
    gone_by = time.monotonic() + 1.0
    while _alive(worker) and time.monotonic() < gone_by:
        time.sleep(0.02)
    assert not _alive(worker)
    assert time.monotonic() - start < 2.6  # before the 3 s bound could have stopped it


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not _zombie(pid)


WIDE_OBJECT = {
    "type": "object",
    "properties": {f"p{i}": {"type": "integer"} for i in range(600)},
    "additionalProperties": False,
}


def test_a_parser_limit_one_token_in_is_400_at_admission(server: ServerProcess) -> None:
    """An ``anyOf`` whose object branch has 600 properties passes llguidance's row limit
    as soon as ``{`` is chosen: the compile probes the openings the grammar allows, so it
    is refused before anything runs (it was a 500 after generation)."""
    schema = {"anyOf": [{"type": "integer"}, WIDE_OBJECT]}
    body = chat(server, response_format=schema_format(schema))
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == SCHEMA_PARAM and error["code"] == "unsupported_schema"
    assert "opens with '{'" in error["message"] and "max is 2000" in error["message"]


def test_a_document_the_grammar_could_not_finish_is_never_stop(server: ServerProcess) -> None:
    """Past a parser limit deeper in the document (the wide branch is a property's
    value) the matcher goes into error and the sampler can only end the request: before
    issue 30 that was 200 "stop" with '{'."""
    schema = {
        "type": "object",
        "properties": {"a": {"anyOf": [{"type": "integer"}, WIDE_OBJECT]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    brace = httpx.post(server.url + "/tokenize", json={"text": "{"}).json()["tokens"][-1]
    body = chat(server, response_format=schema_format(schema), logit_bias={str(brace): 100})
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "grammar_failed" and error["param"] == SCHEMA_PARAM
    streamed = httpx.post(
        server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ).text
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert any(e.get("error", {}).get("code") == "grammar_failed" for e in events)
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
    assert "stop" not in reasons


RESPONSE_BRANCHES = ({"type": "integer"}, {"type": "boolean"}, {"type": "null"}, {"const": 5})


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_the_grammar_could_not_finish_is_never_completed(
    server: ServerProcess, stream: bool
) -> None:
    """The same document through the Responses API (``text.format``): never a response
    that says it is complete with output the grammar refuses, but a 500 naming
    ``text.format.schema`` (streamed: an ``error`` event). The Responses API has no ``logit_bias``
    to choose the wide branch, so the wide object is offered beside each of a few other
    values, and at least one of those requests must take it (the tiny model is fixed)."""
    failed = 0
    for other in RESPONSE_BRANCHES:
        schema = {
            "type": "object",
            "properties": {"a": {"anyOf": [other, WIDE_OBJECT]}},
            "required": ["a"],
            "additionalProperties": False,
        }
        form = {"type": "json_schema", "name": "doc", "schema": schema}
        body = {
            "model": server.model_name,
            "input": "hi",
            "max_output_tokens": 8,
            "temperature": 0,
            "text": {"format": form},
            "stream": stream,
        }
        response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
        if not stream:
            if response.status_code == 500:
                error = response.json()["error"]
                assert error["code"] == "grammar_failed", error
                assert error["param"] == "text.format.schema", error
                failed += 1
                continue
            assert response.status_code == 200, response.text
            reply = response.json()
            if reply["status"] == "completed":
                text = reply["output"][-1]["content"][0]["text"]
                assert set(json.loads(text)) == {"a"}, text  # a whole document
            continue
        lines = response.text.splitlines()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        errors = [e for e in events if e.get("type") == "error"]
        if errors:
            assert errors[0]["code"] == "grammar_failed", errors
            assert errors[0]["param"] == "text.format.schema", errors
            assert not any(e.get("type") == "response.completed" for e in events)
            failed += 1
    assert failed >= 1, "no request took the wide branch: choose other values"


def test_a_template_that_fails_is_the_models_error_not_the_clients(server: ServerProcess) -> None:
    url = server.url + "/v1/chat/completions"
    failed = httpx.post(url, json=chat(server, "boom"), timeout=30)
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == "template_error" and "chat template" in error["message"]
    assert "not iterable" in error["message"] and "--chat-template" in error["message"]
    refused = httpx.post(url, json=chat(server, "refuse"), timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert "no refusals here" in refused.json()["error"]["message"]


def test_a_template_that_cannot_render_warns_at_load(
    model: Model, caplog: pytest.LogCaptureFixture
) -> None:
    model.tokenizer.chat_template = "{% for m in true %}{% endfor %}"
    assert serve_cli.warn_if_template_fails(model.tokenizer, "tiny")
    assert "tiny" in caplog.text and "template_error" in caplog.text
    model.tokenizer.chat_template = TEMPLATE
    assert not serve_cli.warn_if_template_fails(model.tokenizer, "tiny")


def test_hostile_schemas_leave_health_and_chat_and_sigterm_exits_at_once(
    tiny_dirs: dict[str, Path],
) -> None:
    """8 hostile schemas at once: /health answers, a plain chat request still runs, and
    SIGTERM ends the server within 2 s while they compile."""
    process = ServerProcess(
        str(tiny_dirs["llama"]), "--max-seqs", "4", "--max-context", "256",
        "--grammar-timeout", "30", "--grammar-max-bytes", "4GiB", "--grammar-cache-bytes", "4GiB",
    )  # fmt: skip
    url = process.url + "/v1/chat/completions"
    answers: list[int] = []

    def send(n: int) -> None:
        body = chat(process, response_format=schema_format(hostile(40 + n)))
        try:
            answers.append(httpx.post(url, json=body, timeout=20).status_code)
        except httpx.HTTPError:
            answers.append(-1)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(8)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        start = time.monotonic()
        assert httpx.get(process.url + "/health", timeout=2).status_code == 200
        assert time.monotonic() - start < 1.5  # the event loop is not held (loaded CI: slack)
        plain = httpx.post(url, json=chat(process), timeout=10)
        assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"]
        assert len(server_workers(process.process.pid)) == 1  # one compile at a time
        start = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        assert process.process.wait(5) == 0
        assert time.monotonic() - start < 2.0
    finally:
        process.stop()
        for thread in threads:
            thread.join(5)
    assert "Traceback" not in process.output(), process.output()
