"""Every way a bundle can be wrong is refused before anything is allocated, with a typed error
that names the file(s), what was found and the fix; no engine starts, no session is admitted.

Each test builds the broken bundle for real: a copy of a good one with its manifest edited,
a file removed, damaged or taken from another export, or a program lowered for a backend
this runtime lacks. Where the manifest would already catch the change (its SHA-256s), the
test also records the new digests, to reach the runtime's own checks behind it.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.artifact.bundle import MANIFEST, PROGRAM, WEIGHTS, read_bundle
from slotserve.artifact.program import ProgramHalves
from slotserve.artifact.weight_cache import file_digest
from slotserve.errors import ArtifactError, SchemaVersionError
from tests.server.conftest import ServerProcess


def copy_of(bundle: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(bundle, tmp_path / bundle.name))


def edit_manifest(bundle: Path, change: Any, *, rehash: bool = False) -> None:
    fields = json.loads((bundle / MANIFEST).read_text())
    change(fields)
    if rehash:  # a manifest that agrees with the files on disk
        fields["files"] = {name: file_digest(bundle / name) for name in fields["files"]}
    (bundle / MANIFEST).write_text(json.dumps(fields))


def refused(bundle: Path, error: type[Exception] = ArtifactError) -> Exception:
    """The refusal, both where a user meets it (`ss.load` before `ss.Engine`) and where the
    program is opened (`ProgramHalves`, after the manifest's own checks)."""
    with pytest.raises(error) as raised:
        ss.Engine(ss.load(bundle), ss.EngineConfig(max_seqs=1, max_context=64))
    with pytest.raises(error):
        ProgramHalves(read_bundle(bundle))
    return raised.value


def delegate_keys(weights: Path) -> set[str]:
    """The names of the delegates' weights in an ExecuTorch weights file: XNNPACK stores each
    under the SHA-256 of its data (the other entries are named after their modules)."""
    from executorch.extension.flat_tensor.serialize.serialize import (
        _deserialize_to_flat_tensor,
        _get_extended_header,
    )

    data = weights.read_bytes()
    header = _get_extended_header(data)
    assert header is not None, weights
    flat = _deserialize_to_flat_tensor(data[: header.flatbuffer_offset + header.flatbuffer_size])
    return {e.key for e in flat.named_data if len(e.key) == 64 and "." not in e.key}


def test_a_newer_schema_is_refused_with_the_versions_and_the_fix(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    edit_manifest(bundle, lambda f: f.update(schema=3, surprise={"new": "field"}))
    error = refused(bundle, SchemaVersionError)
    assert isinstance(error, SchemaVersionError) and (error.found, error.readable) == (3, (1, 2))
    assert str(bundle / MANIFEST) in str(error)
    assert "bundle schema 3, but this runtime reads schema 1, 2; upgrade slotserve" in str(error)


def test_an_older_schema_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    edit_manifest(bundle, lambda f: f.update(schema=0))
    assert "export the model again" in str(refused(bundle, SchemaVersionError))


def test_a_missing_weights_file_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    (bundle / WEIGHTS).unlink()
    error = refused(bundle)
    assert str(bundle / WEIGHTS) in str(error) and "missing" in str(error)


def test_a_damaged_weights_file_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    data = bytearray((bundle / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bundle / WEIGHTS).write_bytes(bytes(data))
    error = refused(bundle)
    assert "damaged or belongs to another export" in str(error)
    assert str(bundle / WEIGHTS) in str(error) and str(bundle / MANIFEST) in str(error)


def test_the_weights_of_another_export_are_refused(
    tiny_bundle: Path, twin_bundle: Path, tmp_path: Path
) -> None:
    # The same weights under the same names: only the pairing tells the exports apart.
    assert delegate_keys(twin_bundle / WEIGHTS) == delegate_keys(tiny_bundle / WEIGHTS)
    bundle = copy_of(tiny_bundle, tmp_path)
    shutil.copy(twin_bundle / WEIGHTS, bundle / WEIGHTS)
    assert "belongs to another export" in str(refused(bundle))
    # Even with a manifest that agrees with the files, the program and the weights carry
    # different pairing ids: the runtime's own check refuses the pair, naming both files.
    edit_manifest(bundle, lambda f: None, rehash=True)
    error = refused(bundle)
    assert "are from different exports" in str(error) and error.field == "pair_id"  # type: ignore[attr-defined]
    assert str(bundle / PROGRAM) in str(error) and str(bundle / WEIGHTS) in str(error)


def test_weights_of_another_model_are_refused(
    tiny_bundle: Path, tmp_path: Path, q41: tuple[ss.Model, Path]
) -> None:
    # Another model's weights (the tiny Q4_1 GGUF's 8da4w bundle): the program's delegated
    # weights are not all in the file (XNNPACK names data by its hash: what both share is).
    other = q41[1]
    assert delegate_keys(tiny_bundle / WEIGHTS) - delegate_keys(other / WEIGHTS)
    bundle = copy_of(tiny_bundle, tmp_path)
    shutil.copy(other / WEIGHTS, bundle / WEIGHTS)
    edit_manifest(bundle, lambda f: None, rehash=True)
    error = refused(bundle)
    assert error.field == "pair_id"  # type: ignore[attr-defined]
    assert str(bundle / PROGRAM) in str(error) and str(bundle / WEIGHTS) in str(error)


def test_a_missing_method_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    # A manifest for a deeper model than the program: layer 4 is not in it.
    edit_manifest(bundle, lambda f: f["info"].update(n_layers=5))
    error = refused(bundle)
    assert "missing method(s) layer4_out, layer4_qkv" in str(error)
    assert str(bundle / PROGRAM) in str(error)


def test_a_program_for_a_backend_this_runtime_lacks_is_refused(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.backend.test.op_partitioner_demo import AddMulPartitionerDemo

    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + x

    # A real program, lowered for ExecuTorch's demo backend, which has no runtime here.
    program = torch.export.export(Twice(), (torch.randn(2),))
    lowered = to_edge_transform_and_lower({"embed": program}, partitioner=[AddMulPartitionerDemo()])
    bundle = copy_of(tiny_bundle, tmp_path)
    (bundle / PROGRAM).write_bytes(lowered.to_executorch().buffer)
    edit_manifest(bundle, lambda f: None, rehash=True)
    error = refused(bundle)
    assert "lowered for BackendWithCompilerDemo, which this runtime does not have" in str(error)
    assert "XnnpackBackend" in str(error) and "--backend" in str(error)


def patch_identifier(path: Path, old: bytes, new: bytes) -> None:
    """Replace the flatbuffer file identifier (bytes 4..8) of an ExecuTorch file."""
    data = path.read_bytes()
    assert data[4:8] == old, data[:16]
    path.write_bytes(data[:4] + new + data[8:])


EXECUTORCH = metadata.version("executorch")
FORMATS = [(PROGRAM, b"ET12", b"ET99"), (WEIGHTS, b"FT01", b"FT99")]


@pytest.mark.parametrize(("name", "old", "new"), FORMATS, ids=[PROGRAM, WEIGHTS])
def test_an_executorch_format_this_runtime_does_not_read_is_refused_before_loading(
    tiny_bundle: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    old: bytes,
    new: bytes,
) -> None:
    """The design's fourth failure mode: a program or weights file of an ExecuTorch format
    this runtime does not read is a typed refusal (the file, the format found, the formats
    read, the fix), decided from the file's header before ExecuTorch is asked to load it."""
    from executorch.runtime import Runtime

    bundle = copy_of(tiny_bundle, tmp_path)
    patch_identifier(bundle / name, old, new)
    edit_manifest(bundle, lambda f: None, rehash=True)  # the manifest agrees with the files

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ExecuTorch was asked to load a file the checks should refuse")

    monkeypatch.setattr(Runtime, "load_program", never)
    error = refused(bundle, SchemaVersionError)
    assert error.path == str(bundle / name)  # type: ignore[attr-defined]
    assert (error.identifier, error.identifiers) == (new.decode(), (old.decode(),))  # type: ignore[attr-defined]
    assert (error.found, error.readable) == (int(new[2:]), (int(old[2:]),))  # type: ignore[attr-defined]
    assert f"format {new.decode()}, but this runtime (executorch {EXECUTORCH}) reads " in str(error)
    assert f"export the model again with executorch {EXECUTORCH}" in str(error)


def test_a_bundle_of_another_executorch_is_read_when_its_formats_are(
    tiny_bundle: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``writer.executorch`` is compared with the runtime: another version whose files this
    runtime reads is served (and said so); one whose files it cannot read is refused with
    both versions in the fix."""
    bundle = copy_of(tiny_bundle, tmp_path)
    edit_manifest(bundle, lambda f: f["writer"].update(executorch="0.9.0"))
    with caplog.at_level("INFO", logger="slotserve"):
        ProgramHalves(read_bundle(bundle))
    assert f"written by executorch 0.9.0; this runtime (executorch {EXECUTORCH}) reads" in (
        caplog.text
    )
    patch_identifier(bundle / PROGRAM, b"ET12", b"ET11")
    edit_manifest(bundle, lambda f: None, rehash=True)
    error = refused(bundle, SchemaVersionError)
    assert "format ET11" in str(error) and "written by executorch 0.9.0" in str(error)
    assert f"export the model again with executorch {EXECUTORCH}" in str(error)
    assert "or serve it with executorch 0.9.0" in str(error)


def test_a_file_that_is_no_executorch_file_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    (bundle / WEIGHTS).write_bytes(b"not a flatbuffer at all")
    edit_manifest(bundle, lambda f: None, rehash=True)
    error = refused(bundle)
    assert not isinstance(error, SchemaVersionError)
    assert str(bundle / WEIGHTS) in str(error) and "not an ExecuTorch" in str(error)


@pytest.mark.parametrize(("name", "old", "new"), FORMATS, ids=[PROGRAM, WEIGHTS])
def test_fallback_catches_a_format_refusal(
    tiny_bundle: Path,
    tmp_path: Path,
    tiny_dirs: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
    name: str,
    old: bytes,
    new: bytes,
) -> None:
    """``--fallback``'s own path (`open_model`, which catches `ArtifactError`) in-process."""
    import argparse

    from slotserve.cli.executors import open_model

    bundle = copy_of(tiny_bundle, tmp_path)
    patch_identifier(bundle / name, old, new)
    edit_manifest(bundle, lambda f: None, rehash=True)
    fallback = str(tiny_dirs["llama"])
    args = argparse.Namespace(model=str(bundle), fallback=fallback, weights="auto", threads=None)
    with caplog.at_level("ERROR", logger="slotserve"):
        served, model, _ = open_model(args)
    assert served == fallback and model.halves.kind != "program"
    assert f"format {new.decode()}" in caplog.text and "FALLING BACK" in caplog.text


@pytest.mark.parametrize("broken", ["schema", "format"])
def test_serve_falls_back_loudly_when_the_bundle_is_refused(
    tiny_bundle: Path, tmp_path: Path, tiny_dirs: dict[str, Path], broken: str
) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    if broken == "schema":
        edit_manifest(bundle, lambda f: f.update(schema=9))
        said = "bundle schema 9"
    else:  # an ExecuTorch program format this runtime does not read
        patch_identifier(bundle / PROGRAM, b"ET12", b"ET99")
        edit_manifest(bundle, lambda f: None, rehash=True)
        said = "program format ET99"
    fallback = str(tiny_dirs["llama"])
    server = ServerProcess(str(bundle), "--fallback", fallback, "--max-context", "256")
    try:
        assert server.model_name == "llama"  # the fallback's name, not the bundle's
        log = server.output()
        assert "REFUSED" in log and said in log and "FALLING BACK" in log
    finally:
        server.stop()


def test_serve_without_fallback_refuses_to_start(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    (bundle / WEIGHTS).unlink()
    with pytest.raises(RuntimeError, match="missing"):
        ServerProcess(str(bundle))
