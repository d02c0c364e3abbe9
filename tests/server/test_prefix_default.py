"""The server's prefix cache is on by default for the cell layout where exactness holds
(GGUF blocks on the kernels): a repeated history is restored, not recomputed, and the
startup log says how much of the pool it may pin; ``--no-prefix-cache`` turns it off, and a
model without the guarantee (dense fp32 weights) keeps it off and says why."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from slotserve.testing import write_tiny_gguf
from tests.server.conftest import ServerProcess

FLAGS = ("--max-seqs", "2", "--max-context", "256", "--kv-layout", "cell", "--no-web")
HISTORY = [{"role": "user", "content": "Tell me about the sea and the sky."}]


def cached_tokens(server: ServerProcess) -> list[int]:
    """``cached_tokens`` of the same chat asked twice."""
    body = {"model": server.model_name, "messages": HISTORY, "max_tokens": 4, "temperature": 0}
    found = []
    for _ in range(2):
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        details = answer["usage"].get("prompt_tokens_details") or {}
        found.append(details.get("cached_tokens", 0))
    return found


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("served") / "tiny.gguf", qtype="Q8_0")


@pytest.mark.parametrize("off", [False, True], ids=["default", "no-prefix-cache"])
def test_block_weights_reuse_prefixes_by_default(gguf: Path, off: bool) -> None:
    server = ServerProcess(str(gguf), *FLAGS, *(("--no-prefix-cache",) if off else ()))
    try:
        first, second = cached_tokens(server)
    finally:
        assert server.stop() == 0
    assert first == 0
    if off:
        assert second == 0 and "prefix cache on" not in server.output()
    else:
        assert second > 0 and "prefix cache on" in server.output()


def test_dense_weights_keep_it_off_and_say_why(tiny_dirs: dict[str, Path]) -> None:
    server = ServerProcess(str(tiny_dirs["llama"]), *FLAGS)
    try:
        assert cached_tokens(server) == [0, 0]
    finally:
        assert server.stop() == 0
    assert "prefix cache off" in server.output() and "not bit-exact" in server.output()
