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
        if config["model_type"] == "qwen3":
            state[p + "self_attn.q_norm.weight"] = norm(head_dim)
            state[p + "self_attn.k_norm.weight"] = norm(head_dim)
        state[p + "input_layernorm.weight"] = norm(dim)
        state[p + "post_attention_layernorm.weight"] = norm(dim)
    return state


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


def _gguf_tensor_name(hf_name: str) -> str:
    from slotserve.artifact.gguf_file import _GLOBAL_NAMES, _LAYER_NAMES

    inverse_global = {hf: gg for gg, hf in _GLOBAL_NAMES.items()}
    if hf_name in inverse_global:
        return inverse_global[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    suffix = rest.pop()
    inverse_layer = {hf: gg for gg, hf in _LAYER_NAMES.items()}
    return f"blk.{layer}.{inverse_layer['.'.join(rest)]}.{suffix}"


def write_tiny_gguf(path: Path, kind: str = "llama", qtype: str = "F32", seed: int = 0) -> Path:
    """Write the tiny model ``kind`` (llama, qwen2 or qwen3) as a GGUF file, its 2-D weights
    stored as ``qtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...), laid out as llama.cpp's
    converter lays them out (Q/K rows permuted for llama)."""
    import gguf
    import numpy as np

    config = tiny_config(kind)
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
    _add_gguf_tokenizer(writer, config["vocab_size"])
    quant = gguf.GGMLQuantizationType[qtype]
    for name, tensor in random_state_dict(config, seed).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _llama_cpp_permute(tensor, heads if "q_proj" in name else kv_heads)
        array = tensor.numpy().astype(np.float32)
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(array, quant)
            writer.add_tensor(_gguf_tensor_name(name), data, raw_dtype=quant)
        else:
            writer.add_tensor(_gguf_tensor_name(name), array)
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
