"""``slotserve bench servers``: the OpenAI-client driver on a real slotserve server, the
scenario's refusal without llama-server, the report sections "all" keeps, and (where
``make bench-deps`` has built llama-server) the whole scenario on the bundled model."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

import slotserve as ss
from slotserve.bench.llama_server import ENV_BINARY, find_llama_server
from slotserve.bench.processes import slotserve_server
from slotserve.bench.report import keep_sections, replace_section
from slotserve.bench.servers import (
    DECODE_TOKENS,
    PROMPT_TOKENS,
    aggregate_tok_s,
    drive,
    run_servers,
    servers_section,
)


def test_the_driver_times_every_token_of_concurrent_streams(tiny_dirs: dict[str, Path]) -> None:
    server = slotserve_server(
        str(tiny_dirs["llama"]), "--max-seqs", "4", "--max-context", "256", "--no-web"
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompts = [[100 + i + j for j in range(PROMPT_TOKENS)] for i in range(3)]
        streams = drive(client, server.model_name, prompts)
    finally:
        assert server.stop() == 0
    for stream in streams:
        assert stream.completion_tokens == DECODE_TOKENS  # ignore_eos reached the server
        assert stream.ttft > 0
        assert stream.token_times == sorted(stream.token_times)
        assert len(stream.itl) == len(stream.token_times) - 1
    # Sent together (a barrier), so the three streams overlap in time.
    assert max(s.sent for s in streams) < min(s.token_times[-1] for s in streams)
    assert aggregate_tok_s(streams) > 0


def test_servers_is_skipped_without_llama_server(
    tiny: ss.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server() is None
    result = run_servers(tiny, repeats=1)
    assert "make bench-deps" in result["skipped"]
    assert any("Skipped: llama-server is not built" in line for line in servers_section(result))
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="nothing-here is not a file"):
        find_llama_server()


def test_a_full_report_keeps_the_sections_of_their_own_scenarios() -> None:
    old = "# Benchmarks\n\n## single: a\n\nold single\n\n## servers: b\n\nserver rows\n"
    new = "# Benchmarks\n\n## single: a\n\nnew single\n"
    kept = keep_sections(old, new, ("executors", "servers"))
    assert "new single" in kept and "old single" not in kept
    assert kept.count("## servers: b") == 1 and "server rows" in kept
    rerun = new + "\n## servers: b\n\nnew rows\n"
    assert "server rows" not in keep_sections(old, rerun, ("servers",))


def test_a_full_report_keeps_the_hand_written_sections_and_a_rerun_replaces_its_own() -> None:
    old = "# Benchmarks\n\n## single: a\n\nold\n\n## running the benchmarks\n\nhow\n"
    old += "\n## history: figures\n\nthen\n\n## speculative\n\nold speculation\n"
    kept = keep_sections(old, "# Benchmarks\n\n## single: a\n\nnew\n", ("speculative",))
    assert "old" not in kept.replace("old speculation", "")
    assert all(kept.count(text) == 1 for text in ("how", "then", "old speculation"))
    # ``bench speculative`` replaces its section, under the old heading or its own.
    result = {"rows": [], "max_new_tokens": 8, "repeats": 1}
    for document in (old, replace_section(old, "speculative", {"speculative": result}, "x")):
        rewritten = replace_section(document, "speculative", {"speculative": result}, "x")
        assert "old speculation" not in rewritten and rewritten.count("## speculative") == 1


@pytest.mark.skipif(find_llama_server() is None, reason="llama-server: `make bench-deps`")
def test_servers_side_by_side_with_llama_server() -> None:
    # Two levels and 16 tokens: the eager model keeps this under a minute (the full scenario
    # is `slotserve bench servers`).
    result = run_servers(ss.load("bundled"), repeats=1, levels=(1, 2), decode_tokens=16)
    assert [row["streams"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["decode_ratio"] > 0 and row["ttft_ratio"] > 0
        for name in ("slotserve", "llama-server"):
            assert row[name]["aggregate_tok_s"]["median"] > 0
    assert all(result["rss_bytes"].values())
    assert any(line.startswith("| 2 |") for line in servers_section(result))
