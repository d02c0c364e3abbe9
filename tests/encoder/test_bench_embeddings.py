"""``slotserve bench embeddings`` on a few passages: both runtimes timed, the same vectors."""

from __future__ import annotations

from slotserve.bench.embeddings import passages, report, run_embeddings


def test_bench_embeddings_compares_with_sentence_transformers() -> None:
    assert passages(4) == passages(4)
    result = run_embeddings("minilm", n_texts=8, batch=4)
    assert result["slotserve_texts_per_s"] > 0 and result["sentence_transformers_texts_per_s"] > 0
    assert result["max_abs_diff"] <= 1e-4
    table = report(result, markdown=True)
    assert "| slotserve EncoderEngine (fp32) |" in table
    assert "| sentence-transformers encode |" in table
