"""Tiny random-weight models for fast tests, written as real Hugging Face directories.

`write_tiny_hf_dir` writes ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json``, so tests exercise the real loader, and a second implementation
(transformers) can load the very same files. Building one takes milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from slotserve.model import Model

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VOCAB = 272  # 3 special tokens + 256 byte tokens, padded

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": TINY_VOCAB,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "llama3-rope": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "sliding_window": 6,
    },
    # Gemma 3's shape at a tiny size, wide enough for K-quant super-blocks (256 values):
    # local (sliding-window) layers 0 and 2 rotate by their own RoPE, 1 and 3 are global.
    "gemma3": {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "tie_word_embeddings": True,
    },
    "mixed": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 5,
        "max_window_layers": 0,
        "layer_types": [
            "full_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
    },
}


def tiny_config(kind: str) -> dict[str, Any]:
    if kind not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {kind!r}; choose from {sorted(TINY_CONFIGS)}")
    return {**_BASE, **TINY_CONFIGS[kind]}


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: three special tokens, then one token per byte (no merges)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def random_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face names for ``config``."""
    gen = torch.Generator().manual_seed(seed)
    dim, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or dim // heads

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(size: int) -> torch.Tensor:
        return 1.0 + rand(size, scale=0.1)

    state = {
        "model.embed_tokens.weight": rand(vocab, dim, scale=1.0),
        "model.norm.weight": norm(dim),
    }
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = rand(vocab, dim)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (heads * head_dim, dim),
            "self_attn.k_proj": (kv_heads * head_dim, dim),
            "self_attn.v_proj": (kv_heads * head_dim, dim),
            "self_attn.o_proj": (dim, heads * head_dim),
            "mlp.gate_proj": (ffn, dim),
            "mlp.up_proj": (ffn, dim),
            "mlp.down_proj": (dim, ffn),
        }
        for name, shape in shapes.items():
            state[p + name + ".weight"] = rand(*shape)
        if config["model_type"] == "qwen2":
            for name in ("q_proj", "k_proj", "v_proj"):
                state[p + f"self_attn.{name}.bias"] = rand(shapes[f"self_attn.{name}"][0])
        if config["model_type"] in ("qwen3", "gemma3"):
            state[p + "self_attn.q_norm.weight"] = norm(head_dim)
            state[p + "self_attn.k_norm.weight"] = norm(head_dim)
        state[p + "input_layernorm.weight"] = norm(dim)
        state[p + "post_attention_layernorm.weight"] = norm(dim)
        if config["model_type"] == "gemma3":
            state[p + "pre_feedforward_layernorm.weight"] = norm(dim)
            state[p + "post_feedforward_layernorm.weight"] = norm(dim)
    return state


# The tensor types of llama.cpp's Q4_K_M mix, by projection (the rest F32, the
# embedding Q8_0): what `write_tiny_gguf(qtype="Q4_K_M")` writes.
Q4_K_M_TYPES = {
    "q_proj": "Q5_0",
    "k_proj": "Q5_0",
    "v_proj": "Q8_0",
    "o_proj": "Q4_K",
    "gate_proj": "Q5_0",
    "up_proj": "Q5_0",
    "down_proj": "Q6_K",
    "embed_tokens": "Q8_0",
    "lm_head": "Q6_K",
}


# What llama-quantize writes instead of a K-quant for rows that are not whole super-blocks.
K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def random_gguf_rows(kind: str, rows: int, cols: int, seed: int = 0) -> Any:
    """Random valid GGUF blocks of ``kind`` (``[rows, bytes]`` uint8 numpy): the 32-value
    types quantised from random weights by gguf-py; the K-quants (which gguf-py cannot
    quantise) as random bytes with modest fp16 super-block scales."""
    import gguf
    import numpy as np

    gen = np.random.default_rng(seed)
    quant = gguf.GGMLQuantizationType[kind]
    values, size = gguf.GGML_QUANT_SIZES[quant]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        weight = gen.standard_normal((rows, cols)) * gen.uniform(0.01, 1, (rows, 1))
        data = gguf.quants.quantize(weight.astype(np.float32), quant)
        return data.view(np.uint8).reshape(rows, -1).copy()
    # Where each K-quant keeps its fp16 super-block scales: (count, offset).
    scale_fields = {
        "Q2_K": (2, 80),
        "Q3_K": (1, 108),
        "Q4_K": (2, 0),
        "Q5_K": (2, 0),
        "Q6_K": (1, 208),
    }
    if kind not in scale_fields:
        raise ValueError(f"no random blocks for {kind}")
    blocks = gen.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    count, at = scale_fields[kind]
    scales = gen.uniform(2e-5, 3e-4, (rows, cols // values, count)).astype(np.float16)
    blocks[:, :, at : at + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_hf_dir(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random model of ``kind`` (see `TINY_CONFIGS`) as an HF directory."""
    config = tiny_config(kind)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_state_dict(config, seed), str(path / "model.safetensors"))
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def tiny_model(path: Path, kind: str = "llama", seed: int = 0) -> Model:
    """Write and load a tiny random model."""
    from slotserve.artifact import load

    return load(write_tiny_hf_dir(path, kind, seed))


def _llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    # What llama.cpp's converter does to Q/K rows of a "llama" model (rotate-half pairs
    # become adjacent pairs); the GGUF loader must undo it.
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    from slotserve.artifact.gguf_file import _GEMMA3_LAYER_NAMES, _GLOBAL_NAMES, _LAYER_NAMES

    inverse_global = {hf: gg for gg, hf in _GLOBAL_NAMES.items()}
    if hf_name in inverse_global:
        return inverse_global[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    suffix = rest.pop()
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    inverse_layer = {hf: gg for gg, hf in names.items()}
    return f"blk.{layer}.{inverse_layer['.'.join(rest)]}.{suffix}"


def write_tiny_gguf(
    path: Path,
    kind: str = "llama",
    qtype: str = "F32",
    seed: int = 0,
    drop: tuple[str, ...] = (),
    layers: int | None = None,
    pooling_type: int | None = None,
) -> Path:
    """Write the tiny model ``kind`` (llama, qwen2, qwen3 or gemma3) as a GGUF file, its 2-D
    weights stored as ``qtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, ..., or ``Q4_K_M``:
    llama.cpp's mix of types, `Q4_K_M_TYPES`, with random K-quant blocks), laid out as
    llama.cpp's converter lays them out (Q/K rows permuted for llama). The GGUF tensors
    named in ``drop`` are left out (a broken file, for tests); ``layers`` replaces the
    kind's layer count (fewer layers: a quicker export); ``pooling_type`` is written as
    ``{arch}.pooling_type`` (llama.cpp's embedding pooling) where given."""
    import gguf
    import numpy as np

    config = tiny_config(kind)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers={layers} must be >= 1")
        config = {**config, "num_hidden_layers": layers}
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if pooling_type is not None:
        writer.add_uint32(f"{arch}.pooling_type", pooling_type)
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_uint32(
            "gemma3.attention.sliding_window_pattern", config["sliding_window_pattern"]
        )
        writer.add_float32("gemma3.rope.freq_base_swa", config["rope_local_base_freq"])
    _add_gguf_tokenizer(writer, config["vocab_size"])
    for name, tensor in random_state_dict(config, seed).items():
        if _gguf_tensor_name(name, arch) in drop:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _llama_cpp_permute(tensor, heads if "q_proj" in name else kv_heads)
        array = tensor.numpy().astype(np.float32)
        kind_of = qtype
        if qtype == "Q4_K_M":
            kind_of = next((t for part, t in Q4_K_M_TYPES.items() if f"{part}." in name), "F32")
            if array.ndim == 2 and array.shape[1] % 256:  # llama.cpp's fallback types
                kind_of = K_QUANT_FALLBACK.get(kind_of, kind_of)
        quant = gguf.GGMLQuantizationType[kind_of]
        if array.ndim == 2 and kind_of in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
            rows = random_gguf_rows(kind_of, array.shape[0], array.shape[1], seed)
            writer.add_tensor(
                _gguf_tensor_name(name, arch), rows, raw_shape=rows.shape, raw_dtype=quant
            )
        elif array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(array, quant)
            writer.add_tensor(_gguf_tensor_name(name, arch), data, raw_dtype=quant)
        else:
            writer.add_tensor(_gguf_tensor_name(name, arch), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gguf_tokenizer(writer: Any, vocab_size: int) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*SPECIAL_TOKENS, *alphabet]
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    types = [3] * len(SPECIAL_TOKENS) + [1] * len(alphabet)
    types += [5] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
