"""``slotserve bench models`` on tiny chat models and a few MiniLM passages: every part runs
against real servers (llama-server's embeddings where ``make bench-deps`` has built it and
converted MiniLM; its chat and router rows need GGUF chat models, so they are skipped here
with their reason), and the report section renders what ran and what was skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

import slotserve as ss
from slotserve.bench.llama_server import find_llama_server, minilm_gguf_path
from slotserve.bench.models import models_section, run_models
from slotserve.bench.models_index import ONE_PROCESS, SLOTSERVE_BESIDE_LLAMA, TWO_LLAMA
from slotserve.bench.processes import process_tree, tree_memory


def test_a_process_tree_is_the_process_and_its_descendants() -> None:
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_tree(os.getpid()).count(child.pid) == 1
        resident, anonymous = tree_memory([os.getpid()])
        assert resident >= tree_memory([child.pid])[0] > 0 and anonymous > 0
    finally:
        child.kill()
        child.wait()
    assert tree_memory([child.pid]) == (0, 0)  # ended: counts nothing


@pytest.mark.slow
def test_models_runs_every_part_on_tiny_models(tiny_dirs: dict[str, Path]) -> None:
    result = run_models(
        ss.load(tiny_dirs["llama"]),
        repeats=1,
        other=str(tiny_dirs["qwen2"]),
        resident=str(tiny_dirs["qwen3"]),
        passages=8,
        batch=4,
        turn_tokens=8,
        convert=False,  # the conversion downloads llama.cpp's sources: make bench-deps
    )
    assert result["passages"] == 8 and result["passage_tokens"] > 8
    one = result["beside_indexing"][ONE_PROCESS]
    assert one["processes"] == 1 and one["itl_ratio"]["median"] > 0
    assert one["index_texts_per_s_alone"]["median"] > 0 and one["anonymous_bytes"] > 0
    # The server embedded them all, and its tokens are the passages' as MiniLM counts them.
    assert one["index_tokens_alone"] == result["passage_tokens"]
    peer = result["beside_indexing"][SLOTSERVE_BESIDE_LLAMA]
    if find_llama_server() is not None and minilm_gguf_path().is_file():
        assert peer["processes"] == 2 and peer["index_texts_per_s_alone"]["median"] > 0
        # The passages were cut to MiniLM's limit: llama-server embeds the same tokens.
        assert peer["index_tokens_alone"] == result["passage_tokens"]
    else:
        assert "skipped" in peer
    # Tiny Hugging Face models: llama-server's rows need GGUF files, or llama-server itself.
    why = "gguf" if find_llama_server() is not None else "make bench-deps"
    assert why in result["beside_indexing"][TWO_LLAMA]["skipped"].lower()
    assert result["in_process"]["max_abs_diff"] <= 1e-4
    switching = result["switching"]
    ours = switching["slotserve"]
    assert ours["cold_checked"]  # every timed request found its model unloaded
    for model in ours["models"]:
        assert ours["first_token_s_cold"][model]["median"] > 0
    # Room for one of the two on-demand models at a time, and the process kept to it.
    assert ours["peak_anonymous_bytes"] <= ours["budget_bytes"]
    assert why in switching["llama-server router"]["skipped"].lower()
    section = "\n".join(models_section(result))
    assert section.startswith("## models:")
    assert f"| {ONE_PROCESS} |" in section and "skipped: " in section
