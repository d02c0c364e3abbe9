"""The executable llama.cpp's server tests start as their server (`llamacpp_suite`'s
``as-llama-server BACKEND ARGS…``): llama-server's flags translated to ``slotserve serve``
behind a proxy that only sets each request's ``model`` field (`serve_slotserve`), or the
built llama-server with its hub model flags replaced by the bundled GGUF
(`serve_llama_server`). A flag or model neither can stand in for is `Refused`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from slotserve.bench.llama_server import find_llama_server
from slotserve.bench.processes import free_port

# The one hub model of the suite the bundled model stands in for (the tinyllama2 preset).
STAND_IN_REPO = "ggml-org/test-model-stories260K"
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
