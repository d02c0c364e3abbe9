"""A bundle's own metadata is read at load: each constant method of the program (ExecuTorch's
runner metadata and the bundle's schema) must return what the manifest records, and the
manifest's KV contract must be the runtime's. A manifest that disagrees is refused, naming
the constant method, the program's value, the manifest's field and its value.

Each test edits the manifest of a copy of a real exported bundle (the manifest is not
hashed itself, so every other check still passes and the program is the one that answers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.artifact.bundle import KV_CONTRACT, MANIFEST, PROGRAM, read_bundle
from slotserve.artifact.program import ProgramHalves
from tests.export.test_bundle_checks import copy_of, edit_manifest, refused


def set_field(fields: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, name = dotted.split(".")
    for parent in parents:
        fields = fields[parent]
    fields[name] = value


# (the manifest field, the value written there, the constant method, what the program returns)
DISAGREEMENTS = [
    ("max_context", 128, "get_max_context_len", "256"),
    ("max_tokens", 256, "get_max_seq_len", "512"),
    ("info.eos_ids", [3], "get_eos_ids", "2"),
    ("info.bos_id", 1, "get_bos_id", "0"),
    ("info.n_layers", 3, "get_n_layers", "4"),
    ("info.vocab_size", 300, "get_vocab_size", "272"),
    ("schema", 2, "get_bundle_schema", "1"),
]


def test_the_tiny_bundle_is_what_the_table_expects(tiny_bundle: Path) -> None:
    """The values the table below edits away from, read from the program itself."""
    manifest = read_bundle(tiny_bundle).manifest
    halves = ProgramHalves(read_bundle(tiny_bundle))
    program = halves._program
    for name, recorded in manifest.constants.items():
        expected = recorded if isinstance(recorded, list) else [recorded]
        assert list(program.load_method(name).execute([])) == expected, name
    assert (manifest.max_context, manifest.max_tokens, manifest.schema) == (256, 512, 1)
    assert (manifest.info.eos_ids, manifest.info.bos_id) == ((2,), 0)
    assert (manifest.info.n_layers, manifest.info.vocab_size) == (4, 272)


@pytest.mark.parametrize(("field", "value", "method", "in_program"), DISAGREEMENTS)
def test_a_manifest_that_disagrees_with_the_programs_constants_is_refused(
    tiny_bundle: Path, tmp_path: Path, field: str, value: Any, method: str, in_program: str
) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    edit_manifest(bundle, lambda fields: set_field(fields, field, value))
    error = refused(bundle)
    assert isinstance(error, ss.ArtifactError) and error.field == method
    assert error.path == str(bundle / PROGRAM)
    assert f"{method}() returns {in_program}, but {bundle / MANIFEST} records " in str(error)
    assert f"{field} = {value!r}" in str(error) and "export the model again" in str(error)


def test_a_kv_contract_the_runtime_does_not_keep_is_refused(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    bundle = copy_of(tiny_bundle, tmp_path)
    other = "in-graph: the program's methods own a KV cache buffer"
    edit_manifest(bundle, lambda fields: fields.update(kv_contract=other))
    error = refused(bundle)
    assert isinstance(error, ss.ArtifactError) and error.field == "kv_contract"
    assert error.path == str(bundle / MANIFEST)
    assert repr(other) in str(error) and repr(KV_CONTRACT) in str(error)
