"""Side-by-side baselines on the same weights, same prompts, same token counts, greedy:
Hugging Face transformers ``generate()`` and llama-cpp-python (if installed).

Each is optional; a missing one is reported as skipped with the install hint.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from slotserve.bench.single import DECODE_TOKENS


def _gguf_path(spec: str) -> Path | None:
    from slotserve.artifact import model_path

    path = model_path(spec)
    return path if path.suffix == ".gguf" else None


def _prompts(rows: list[dict[str, Any]], vocab: int) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        r["prompt_tokens"]: torch.randint(100, vocab, (r["prompt_tokens"],), generator=gen).tolist()
        for r in rows
    }


def transformers_baseline(spec: str, single: dict[str, Any], repeats: int = 3) -> dict[str, Any]:
    try:
        import transformers
    except ImportError:
        return {"skipped": "pip install transformers"}
    path = _gguf_path(spec)
    model: Any
    if path is not None:
        model = _transformers_from_gguf(transformers, path)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
    model.eval()
    rows = []
    for length, prompt in _prompts(single["rows"], model.config.vocab_size).items():
        ids = torch.tensor([prompt])
        rates = []
        for _ in range(repeats):
            with torch.inference_mode():
                # Time the decode alone: generate(1) is the prefill + first token.
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=1, do_sample=False)
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                model.generate(
                    ids,
                    max_new_tokens=DECODE_TOKENS + 1,
                    min_new_tokens=DECODE_TOKENS + 1,
                    do_sample=False,
                )
                total = time.perf_counter() - start
            rates.append(DECODE_TOKENS / max(total - prefill, 1e-9))
        rows.append({"prompt_tokens": length, "decode_tok_s": statistics.median(rates)})
    return {"version": transformers.__version__, "rows": rows}


def _transformers_from_gguf(transformers: Any, path: Path) -> Any:
    """A transformers Llama with the GGUF's dequantised weights (as slotserve reads them;
    transformers' own GGUF path needs extra packages)."""
    from slotserve.artifact.gguf_file import (
        iter_tensors,
        model_info_from_gguf,
        open_gguf,
        read_metadata,
    )

    reader = open_gguf(path)
    info = model_info_from_gguf(read_metadata(reader), {t.name for t in reader.tensors}, path)
    if info.arch != "llama":
        raise ValueError(f"the transformers baseline supports llama GGUFs, not {info.arch}")
    config = transformers.LlamaConfig(
        hidden_size=info.dim,
        intermediate_size=info.ffn_dim,
        num_hidden_layers=info.n_layers,
        num_attention_heads=info.n_heads,
        num_key_value_heads=info.n_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_position_embeddings=info.max_context,
        rms_norm_eps=info.norm_eps,
        rope_theta=info.rope.theta,
        tie_word_embeddings=info.tied_embeddings,
    )
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(
        dict(iter_tensors(reader, info, path)), strict=False
    )
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float()


def llama_cpp_baseline(spec: str, single: dict[str, Any], repeats: int = 3) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed; `make bench-deps` builds it"}
    path = _gguf_path(spec)
    if path is None:
        return {"skipped": "llama.cpp needs a .gguf model"}
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False
    )
    rows = []
    for length, prompt in _prompts(single["rows"], llm.n_vocab()).items():
        rates = []
        for _ in range(repeats):
            llm.reset()
            llm.eval(prompt)
            start = time.perf_counter()
            for _ in range(DECODE_TOKENS):
                token = llm.sample(top_k=1)
                llm.eval([token])
            rates.append(DECODE_TOKENS / (time.perf_counter() - start))
        rows.append({"prompt_tokens": length, "decode_tok_s": statistics.median(rates)})
    return {"version": llama_cpp.__version__, "rows": rows}


def run_baselines(spec: str, single: dict[str, Any]) -> dict[str, Any]:
    return {
        "transformers": transformers_baseline(spec, single),
        "llama.cpp": llama_cpp_baseline(spec, single),
    }
