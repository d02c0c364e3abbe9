"""Each model family and weight format against llama.cpp's own outputs (references made by
``tools/llama_refs.py``; their meta names the file): tokenisation equal on every prompt,
teacher-forced agreement at least 95%, and every position where llama.cpp's top-1 leads
by a logit margin of 1.0 or more agrees (`tests.artifact.parity`), with the default fp16
KV and with fp32 KV. The block weights run as loaded (the file's own types, fused C
halves)."""

from __future__ import annotations

import pytest

import slotserve as ss
from slotserve.bench.llama_server import smollm2_q4_k_m_path
from tests.artifact.parity import check

KV_DTYPES = ["fp16", "fp32"]  # the default, and twice its bytes


@pytest.fixture(scope="module")
def smollm2_q4_k_m() -> ss.Model:
    path = smollm2_q4_k_m_path()  # what `make bench-deps` writes
    if not path.is_file():
        pytest.skip(f"{path} is made by `make bench-deps` (llama-quantize)")
    return ss.load(path, progress=False)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gemma3_matches_llama_cpp(gemma3: ss.Model, kv_dtype: str) -> None:
    """Two prompts run past the 512-token window of the five local layers in six."""
    assert gemma3.halves.kind == "block"
    check(gemma3, "llamacpp_gemma3.json", kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_smollm2_q4_k_m_matches_llama_cpp(smollm2_q4_k_m: ss.Model, kv_dtype: str) -> None:
    assert smollm2_q4_k_m.halves.kind == "block"
    check(smollm2_q4_k_m, "llamacpp_smollm2_q4_k_m.json", kv_dtype)
