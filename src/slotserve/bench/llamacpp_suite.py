"""llama.cpp's own server tests (``tools/server/tests`` in the ``llama-cpp-python`` sdist), run
unchanged against slotserve and against ``llama-server``, both on the bundled SmolLM2 GGUF.

The suite starts its server as ``$LLAMA_SERVER_BIN_PATH ARGS…`` (its ``utils.ServerProcess``)
with llama-server's flags. This module is that executable for both sides
(``as-llama-server BACKEND ARGS…``):

- ``llama-server``: the built binary (``make bench-deps``), its hub model flags replaced by
  ``--model`` and the bundled GGUF;
- ``slotserve``: ``slotserve serve`` with the flags translated (`translate`), behind a thin
  proxy on the suite's port that only sets each request's ``model`` field to the served
  name (llama-server answers any name; slotserve answers 404 for a name it does not serve).

Only the suite's ``tinyllama2`` preset (``ggml-org/test-model-stories260K``) maps to the
bundled model; any other hub model, and a flag with no slotserve counterpart that would
change what a test sees, is refused at start (the test errors with the reason in its output).
Nothing is downloaded from a model hub: the suite's session fixture that fetches every preset
(``ServerPreset.load_all``) is switched off by `llamacpp_suite_plugin`, which also stands in
for the ``wget`` module the suite imports and never calls here.

Run it (the suite is unpacked once into the cache dir, from the sdist ``pip download`` gets)::

    python -m slotserve.bench.llamacpp_suite --backend both --out /tmp/llamacpp-suite

It writes ``BACKEND.xml`` (JUnit) per side and ``summary.md``: each test's outcome on each
side, llama-server's passes, and how many of them slotserve passes. ``--suite DIR`` names an
unpacked ``vendor/llama.cpp`` instead; arguments after ``--`` go to pytest (``-k``, more
files).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION, find_llama_server
from slotserve.bench.processes import free_port
from slotserve.paths import cache_dir

BACKENDS = ("llama-server", "slotserve")
SOURCE = Path(__file__).resolve().parents[2]  # the folder slotserve is imported from
# The suite's tests of the features compared, each with every parametrisation: stream
# chunk shapes, grammars and JSON schemas, tool calls (plain and streamed), past reasoning
# in the template, and the Anthropic and Responses streams (the suite has no test of a tool
# call cut by max_tokens, nor of typical_p, DRY, XTC, min_tokens, top_n_sigma or mirostat). Each
# test starts its own server; `--all-files` runs the whole of `FILES` instead.
SELECTED = (
    "unit/test_chat_completion.py::test_chat_completion_stream",
    "unit/test_chat_completion.py::test_chat_completion_with_openai_library",
    "unit/test_chat_completion.py::test_completion_with_response_format",
    "unit/test_chat_completion.py::test_completion_with_json_schema",
    "unit/test_chat_completion.py::test_completion_with_grammar",
    "unit/test_chat_completion.py::test_completion_with_invalid_grammar",
    "unit/test_chat_completion.py::test_chat_completion_with_timings_per_token",
    "unit/test_chat_completion.py::test_logprobs",
    "unit/test_chat_completion.py::test_logprobs_stream",
    "unit/test_tool_call.py::test_completion_without_tool_call_fast",
    "unit/test_compat_anthropic.py::test_anthropic_messages_streaming",
    "unit/test_compat_anthropic.py::test_anthropic_tool_use_basic",
    "unit/test_compat_anthropic.py::test_anthropic_tool_result",
    "unit/test_compat_anthropic.py::test_anthropic_tool_streaming",
    "unit/test_compat_anthropic.py::test_anthropic_streaming_content_block_indices",
    "unit/test_compat_anthropic.py::test_anthropic_thinking_history_in_count_tokens",
    "unit/test_compat_anthropic.py::test_anthropic_thinking_history_in_template",
    "unit/test_compat_oai_responses.py::test_responses_stream_with_openai_library",
)
FILES = (
    "unit/test_chat_completion.py",
    "unit/test_tool_call.py",
    "unit/test_template.py",
    "unit/test_compat_anthropic.py",
    "unit/test_compat_oai_responses.py",
)
# Tests of a model other than the bundled one's stand-in (a vision model).
DESELECTED = ("unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model",)
# The one hub model of the suite the bundled model stands in for (the tinyllama2 preset).
STAND_IN_REPO = "ggml-org/test-model-stories260K"
SUITE_PARTS = ("tools/server/tests/", "models/templates/")
# Routes whose JSON body names a model.
MODEL_ROUTES = (
    "chat/completions",
    "completions",
    "completion",
    "responses",
    "messages",
    "messages/count_tokens",
    "embeddings",
)


class Refused(Exception):
    """A llama-server flag (or value) the chosen backend cannot stand in for."""


def _value(args: list[str], index: int, flag: str) -> str:
    if index + 1 >= len(args):
        raise Refused(f"{flag} needs a value")
    return args[index + 1]


def model_flags(repo: str | None, file: str | None, model: str | None) -> None:
    """Refuse every model but the tinyllama2 preset's, which the bundled model stands in for."""
    if model is not None or file is not None or repo != STAND_IN_REPO:
        named = model or f"{repo}/{file}" if file else model or repo
        raise Refused(
            f"the model {named!r} would come from a hub or a file; only {STAND_IN_REPO} "
            "(the suite's tinyllama2 preset) maps to the bundled model"
        )


# slotserve's default step size, the most taken from --batch-size (a larger step only
# lengthens the server's start, which times its largest step).
MAX_BATCH_TOKENS = 512
# llama-server flags the suite passes, by what slotserve makes of them.
DROPPED_WITH_VALUE = {
    "--seed",  # the server's default seed: slotserve has none; requests give their own
    "--ubatch-size",  # a scheduling size, not an output
    "--threads",
    "--n-gpu-layers",
    "--n-predict",  # the default budget: every request compared gives max_tokens
    "-fa",
}
DROPPED_SWITCHES = {
    "--offline",
    "--slots",
    "--no-slots",
    "--jinja",  # slotserve always renders the Jinja template
    "--no-jinja",
    "--cont-batching",
    "--metrics",  # always on
    "--kv-unified",
    "--no-ui",
}


def translate(args: list[str]) -> tuple[list[str], int]:
    """The ``slotserve serve`` flags for llama-server's ``args``, and the port the suite
    expects (the proxy's). Raises `Refused` naming a flag with no counterpart."""
    out: list[str] = ["--model", "bundled", "--kv-layout", "cell"]  # cell: a prompt cache
    port = 8080
    repo: str | None = None
    file: str | None = None
    model: str | None = None
    ctx: int | None = None
    parallel = 1
    index = 0
    while index < len(args):
        flag = args[index]
        if flag in DROPPED_SWITCHES:
            index += 1
            continue
        if flag == "--verbose":
            out += ["--log-level", "debug"]
            index += 1
            continue
        value = _value(args, index, flag)
        index += 2
        if flag in DROPPED_WITH_VALUE:
            continue
        if flag == "--port":
            port = int(value)
        elif flag == "--host":
            out += ["--host", value.split(",")[0].strip()]
        elif flag == "--batch-size":  # the most tokens a step computes, as llama.cpp's
            out += ["--max-batch-tokens", str(min(int(value), MAX_BATCH_TOKENS))]
        elif flag == "--temp":
            out += ["--temperature", value]
        elif flag == "--hf-repo":
            repo = value
        elif flag == "--hf-file":
            file = value
        elif flag in ("--model", "--model-url"):
            model = value
        elif flag == "--alias":
            out += ["--served-model-name", value.split(",")[0]]
        elif flag == "--ctx-size":
            ctx = int(value)
        elif flag == "--parallel":
            parallel = int(value)
        elif flag == "--chat-template-file":
            out += ["--chat-template", str(Path(value).resolve())]
        elif flag == "--api-key":
            out += ["--api-key", value]
        elif flag == "--cors-origins":
            for origin in value.split(","):
                out += ["--cors-origin", origin.strip()]
        elif flag == "--reasoning-format" and value in ("deepseek", "auto", "none"):
            out += ["--reasoning-format", "none" if value == "none" else "auto"]
        elif flag == "--reasoning" and value == "auto":
            continue
        else:
            raise Refused(
                f"llama-server's {flag} {value} has no counterpart in slotserve serve "
                "(built-in template names, --reasoning on/off, KV types, … are llama.cpp's)"
            )
    model_flags(repo, file, model)
    out += ["--max-seqs", str(parallel)]
    if ctx is not None:  # llama.cpp splits its context among the slots
        out += ["--max-context", str(ctx // parallel)]
    return out, port


def llama_server_args(args: list[str], gguf: Path) -> list[str]:
    """``args`` with the hub model flags replaced by ``--model GGUF`` (and ``--offline``,
    which only stops downloads, dropped)."""
    out: list[str] = []
    repo: str | None = None
    file: str | None = None
    model: str | None = None
    index = 0
    while index < len(args):
        flag = args[index]
        if flag in ("--hf-repo", "--hf-file", "--model", "--model-url"):
            value = _value(args, index, flag)
            if flag == "--hf-repo":
                repo = value
            elif flag == "--hf-file":
                file = value
            else:
                model = value
            index += 2
        elif flag == "--offline":
            index += 1
        else:
            out.append(flag)
            index += 1
    model_flags(repo, file, model)
    return ["--model", str(gguf), *out]


class ModelProxy:
    """Forwards every request to slotserve's server at ``upstream``, unchanged but for the
    JSON body's ``model`` on `MODEL_ROUTES`, set to the name the server serves."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client = httpx.AsyncClient(base_url=upstream, timeout=None)
        self.served: str | None = None

    async def served_name(self) -> str:
        if self.served is None:
            reply = await self.client.get("/v1/models")
            self.served = str(reply.json()["data"][0]["id"])
        return self.served

    async def body(self, path: str, raw: bytes) -> bytes:
        if not path.strip("/").removeprefix("v1/").endswith(MODEL_ROUTES):
            return raw
        try:
            data = json.loads(raw)
        except ValueError:
            return raw
        if not isinstance(data, dict):
            return raw
        data["model"] = await self.served_name()
        return json.dumps(data).encode()

    def app(self) -> object:
        """The proxy's ASGI app."""
        from starlette.applications import Starlette
        from starlette.background import BackgroundTask
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        hop = {"host", "content-length", "transfer-encoding", "connection"}

        async def forward(request: Request) -> Response:
            raw = await request.body()
            if request.method == "POST":
                raw = await self.body(request.url.path, raw)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
            upstream = self.client.build_request(
                request.method,
                request.url.path,
                params=request.url.query,
                content=raw,
                headers=headers,
            )
            try:
                reply = await self.client.send(upstream, stream=True)
            except httpx.ConnectError:
                return JSONResponse({"status": "loading"}, 503)

            async def chunks() -> AsyncIterator[bytes]:
                async for chunk in reply.aiter_raw():
                    yield chunk

            kept = {k: v for k, v in reply.headers.items() if k.lower() not in hop}
            return StreamingResponse(
                chunks(), reply.status_code, kept, background=BackgroundTask(reply.aclose)
            )

        methods = ["GET", "POST", "DELETE", "OPTIONS", "PUT"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def _die_with_parent() -> None:
    """In the server's child process: SIGTERM when this wrapper dies (the suite kills a
    wrapper that outlives its stop timeout), so no server outlives its test (Linux)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def serve_slotserve(args: list[str]) -> int:
    """``slotserve serve`` on a free port with the translated flags, and the proxy on the
    suite's port until SIGTERM (or the server's exit, whose status is returned)."""
    import uvicorn

    try:
        flags, port = translate(args)
    except Refused as refusal:
        print(f"llamacpp_suite: refused: {refusal}", file=sys.stderr, flush=True)
        return 2
    inner = free_port()
    command = [sys.executable, "-m", "slotserve.cli", "serve", *flags, "--port", str(inner)]
    print(f"llamacpp_suite: {' '.join(command)}", file=sys.stderr, flush=True)
    child = subprocess.Popen(command, preexec_fn=_die_with_parent)
    proxy = ModelProxy(f"http://127.0.0.1:{inner}")
    config = uvicorn.Config(proxy.app(), host="127.0.0.1", port=port, log_level="warning")  # type: ignore[arg-type]
    server = uvicorn.Server(config)

    def watch() -> None:
        child.wait()
        server.should_exit = True

    threading.Thread(target=watch, daemon=True).start()
    try:
        asyncio.run(server.serve())
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
    return child.returncode if child.returncode not in (None, 0, -signal.SIGTERM) else 0


def serve_llama_server(args: list[str]) -> int:
    """The built llama-server on the bundled GGUF, in this process's place."""
    from slotserve.artifact import bundled_gguf_path

    binary = find_llama_server()
    if binary is None:
        print("llamacpp_suite: build llama-server first: make bench-deps", file=sys.stderr)
        return 2
    try:
        command = [str(binary), *llama_server_args(args, bundled_gguf_path())]
    except Refused as refusal:
        print(f"llamacpp_suite: refused: {refusal}", file=sys.stderr, flush=True)
        return 2
    print(f"llamacpp_suite: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(command[0], command)


def suite_dir() -> Path:
    """The unpacked ``vendor/llama.cpp`` (its server tests and chat templates), once."""
    from rich.console import Console

    from slotserve.bench.llama_server import llama_cpp_sources

    target = cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "suite"
    if (target / "tools" / "server" / "tests" / "utils.py").is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="slotserve-suite-") as tmp:
        source = llama_cpp_sources(Path(tmp), Console(stderr=True), SUITE_PARTS)
        partial = target.with_name(f".suite.{os.getpid()}")
        shutil.copytree(source, partial)
        partial.replace(target)
    return target


def wrapper_script(folder: Path, backend: str) -> Path:
    """An executable that runs ``as-llama-server BACKEND`` in this interpreter."""
    script = folder / f"llama-server-as-{backend}"
    source = str(SOURCE)
    script.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{source}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" '
        f'-m slotserve.bench.llamacpp_suite as-llama-server {backend} "$@"\n'
    )
    script.chmod(0o755)
    return script


def run_suite(
    backend: str, llama_cpp: Path, out: Path, tests: tuple[str, ...], extra: list[str]
) -> Path:
    """Run the selected tests with ``backend`` as the suite's server; returns the JUnit file."""
    folder = llama_cpp / "tools" / "server" / "tests"
    junit = out / f"{backend}.xml"
    source = str(SOURCE)
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(wrapper_script(out, backend)),
        "PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])),
    }
    env.pop("DEBUG", None)
    command = [sys.executable, "-m", "pytest", *tests, "-m", "not slow", "-v"]
    command += ["-p", "slotserve.bench.llamacpp_suite_plugin", "-p", "no:cacheprovider"]
    command += [f"--deselect={test}" for test in DESELECTED]
    command += [f"--junitxml={junit}", "-o", "junit_family=xunit1", *extra]
    with open(out / f"{backend}.log", "w") as log:
        subprocess.run(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    return junit


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Test id -> (passed / failed / error / skipped, the first line of why)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').removeprefix('unit.')}::{case.get('name')}"
        outcome, why = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = "failed" if kind == "failure" else kind
                why = (element.get("message") or "").strip().split("\n")[0][:160]
                break
        found[name] = (outcome, why)
    return found


def summary(results: dict[str, dict[str, tuple[str, str]]]) -> str:
    """The Markdown comparison of the two sides' outcomes."""
    ours = results.get("slotserve", {})
    theirs = results.get("llama-server", {})
    names = sorted(set(ours) | set(theirs))
    passed_there = [n for n in names if theirs.get(n, ("",))[0] == "passed"]
    passed_both = [n for n in passed_there if ours.get(n, ("",))[0] == "passed"]
    lines = [
        f"{len(names)} tests; llama-server passed {len(passed_there)}, slotserve passed "
        f"{len(passed_both)} of those ({sum(o[0] == 'passed' for o in ours.values())} in all).",
        "",
        "| test | llama-server | slotserve | slotserve's failure |",
        "| --- | --- | --- | --- |",
    ]
    for name in names:
        there = theirs.get(name, ("not run", ""))
        here = ours.get(name, ("not run", ""))
        why = here[1].replace("|", "\\|") if here[0] != "passed" else ""
        lines.append(f"| `{name}` | {there[0]} | {here[0]} | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``as-llama-server BACKEND ARGS…`` (the suite's server) or the runner (see the module
    docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["as-llama-server"]:
        backend, rest = argv[1], argv[2:]
        return serve_slotserve(rest) if backend == "slotserve" else serve_llama_server(rest)
    parser = argparse.ArgumentParser(prog="python -m slotserve.bench.llamacpp_suite")
    parser.add_argument("--backend", choices=[*BACKENDS, "both"], default="both")
    parser.add_argument("--suite", type=Path, help="an unpacked vendor/llama.cpp")
    parser.add_argument("--out", type=Path, default=Path("llamacpp-suite"))
    parser.add_argument("--all-files", action="store_true", help="every test of FILES")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    options = parser.parse_args(argv)
    llama_cpp = (options.suite or suite_dir()).resolve()
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    backends = BACKENDS if options.backend == "both" else (options.backend,)
    tests = FILES if options.all_files else SELECTED
    results = {}
    for backend in backends:
        junit = run_suite(backend, llama_cpp, out, tests, options.pytest_args)
        results[backend] = outcomes(junit)
    for backend in BACKENDS:  # a side run before keeps its results in the summary
        junit = out / f"{backend}.xml"
        if backend not in results and junit.is_file():
            results[backend] = outcomes(junit)
    text = summary(results)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
