"""A bundle: the exported artifact, a directory the runtime can check before it loads anything.

    manifest.json   what the bundle is (schema version, model, methods, KV contract, files)
    program.pte     the ExecuTorch program: the model's methods and constant methods
    weights.ptd     the program's weights (ExecuTorch named data), shared by every method
    tokenizer.json  the tokenizer and chat template (`Tokenizer.to_json`)

`read_bundle` reads the manifest and checks the schema version, every file's SHA-256 and the
KV contract: a bundle this runtime cannot read, or whose files are missing, damaged or from
another export, is refused here with a typed error, before any weights are read or any
memory is planned. The checks that need the ExecuTorch runtime (the formats of the program
and weights files against the ones it reads, its delegates, the program's methods, its
constant methods against the manifest, the program/weights pairing id) are
`slotserve.artifact.program`'s; `file_identifier` reads a file's format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from slotserve.artifact.weight_cache import file_digest
from slotserve.errors import ArtifactError, SchemaVersionError
from slotserve.info import ModelInfo
from slotserve.tokenizer import Tokenizer

BUNDLE_SCHEMA = 2
"""The newest schema this runtime writes (a bundle records the oldest schema that describes
it: 1 unless it needs `TIED_EMBEDDING_SCHEMA`)."""
READABLE_SCHEMAS = (1, 2)
"""The schemas this runtime reads."""
TIED_EMBEDDING_SCHEMA = 2
"""Schema 2 adds ``tied_embedding``: a tied embedding stored once, as the head's weights,
which the runtime maps from the weights file and passes to the ``embed`` method."""

MANIFEST = "manifest.json"
PROGRAM = "program.pte"
WEIGHTS = "weights.ptd"
TOKENIZER = "tokenizer.json"
WEIGHTS_TAG = "weights"  # ExecuTorch's name for the external data: `WEIGHTS` is its file

KV_CONTRACT = (
    "off-graph: no method owns KV state. layer{i}_qkv returns the step's rotated q, k, v rows; "
    "the runtime writes k, v into its pool and attends (flat, ring or cell layout); "
    "layer{i}_out takes the attention output."
)

CONSTANT_FIELDS = {
    "get_max_seq_len": "max_tokens",
    "get_max_context_len": "max_context",
    "get_bos_id": "info.bos_id",
    "get_eos_ids": "info.eos_ids",
    "get_vocab_size": "info.vocab_size",
    "get_n_layers": "info.n_layers",
    "use_kv_cache": "kv_contract",
    "enable_dynamic_shape": "methods",
    "get_bundle_schema": "schema",
}
"""The program's constant methods (ExecuTorch's runner metadata and the bundle's schema),
each with the manifest field that records the same fact (`constant_methods`)."""


def constant_methods(
    info: ModelInfo, max_tokens: int, max_context: int, schema: int
) -> dict[str, Any]:
    """What each of `CONSTANT_FIELDS` returns: written into the program at export, compared
    with the manifest at load (`Manifest.constants`), so both describe the same program."""
    return {
        "get_max_seq_len": max_tokens,
        "get_max_context_len": max_context,
        "get_bos_id": info.bos_id if info.bos_id is not None else -1,
        "get_eos_ids": list(info.eos_ids) or [-1],
        "get_vocab_size": info.vocab_size,
        "get_n_layers": info.n_layers,
        "use_kv_cache": True,  # off-graph: the runtime's pool holds the KV (`KV_CONTRACT`)
        "enable_dynamic_shape": True,  # the token axis of every method is dynamic
        "get_bundle_schema": schema,
    }


@dataclass(frozen=True)
class MethodSpec:
    """One method of the program: its inputs' and outputs' shapes (``"T"`` is the dynamic
    token count, at most the bundle's ``max_tokens``) and dtypes."""

    name: str
    inputs: tuple[tuple[str | int, ...], ...]
    outputs: tuple[tuple[str | int, ...], ...]
    dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``. ``files`` maps each file of the bundle to its SHA-256; ``pair_id``
    is also written into the program (a constant method) and into the weights (a tensor), so
    a program and a weights file from different exports never run together."""

    schema: int
    writer: dict[str, str]
    model: dict[str, str]
    info: ModelInfo
    backend: str
    delegates: tuple[str, ...]
    quant: str
    max_tokens: int
    max_context: int
    methods: tuple[MethodSpec, ...]
    pair_id: str
    files: dict[str, str]
    load_options: dict[str, Any] = field(default_factory=dict)
    kv_contract: str = KV_CONTRACT
    readable_by: tuple[int, ...] = READABLE_SCHEMAS
    tied_embedding: dict[str, Any] | None = None
    """Schema 2: where the head's weights that ``embed`` reads lie in the weights file,
    ``{"rows": {"offset", "dtype", "shape"}, "scales": {…}}`` (``scales`` for int8 rows)."""

    @property
    def method_names(self) -> tuple[str, ...]:
        return tuple(method.name for method in self.methods)

    @property
    def constants(self) -> dict[str, Any]:
        """What the program's constant methods must return for this manifest."""
        return constant_methods(self.info, self.max_tokens, self.max_context, self.schema)

    def to_json(self) -> str:
        fields = asdict(self)
        fields["info"] = json.loads(self.info.to_json())
        if self.tied_embedding is None:
            del fields["tied_embedding"]  # a schema-1 manifest, as schema-1 readers read it
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> Manifest:
        fields = dict(fields)
        fields["info"] = ModelInfo.from_json(json.dumps(fields["info"]))
        fields["methods"] = tuple(
            MethodSpec(
                m["name"],
                tuple(tuple(s) for s in m["inputs"]),
                tuple(tuple(s) for s in m["outputs"]),
                tuple(m.get("dtypes", ())),
            )
            for m in fields["methods"]
        )
        fields["delegates"] = tuple(fields["delegates"])
        fields["readable_by"] = tuple(fields.get("readable_by", (fields["schema"],)))
        return cls(**fields)


@dataclass(frozen=True)
class Bundle:
    """A bundle whose manifest was read and whose files match it."""

    directory: Path
    manifest: Manifest
    tokenizer: Tokenizer

    @property
    def info(self) -> ModelInfo:
        """The model's info with the context the bundle serves (at most the model's)."""
        return replace(self.manifest.info, max_context=self.manifest.max_context)

    @property
    def resident_bytes(self) -> int:
        """What the runtime keeps resident for the weights: the program and its weights file
        (XNNPACK packs the weights once, at load)."""
        return self.program.stat().st_size + self.weights.stat().st_size

    @property
    def program(self) -> Path:
        return self.directory / PROGRAM

    @property
    def weights(self) -> Path:
        return self.directory / WEIGHTS


def is_bundle(path: str | Path) -> bool:
    """Whether ``path`` is a bundle directory (it holds a manifest)."""
    return (Path(path) / MANIFEST).is_file()


def read_bundle(directory: str | Path) -> Bundle:
    """Read and check the bundle at ``directory``: `SchemaVersionError` for a schema this
    runtime does not read, `ArtifactError` for a missing, damaged or mismatched file."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files(directory, manifest)
    check_kv_contract(directory, manifest)
    check_tied_embedding(directory, manifest)
    tokenizer = Tokenizer.from_json(
        (directory / TOKENIZER).read_text(),
        chat_template_source=f"{directory / TOKENIZER} [chat_template]",
    )
    return Bundle(directory, manifest, tokenizer)


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(path, "no manifest: not a bundle; write one with `slotserve export`")
    try:
        fields = json.loads(path.read_text())
        schema = fields["schema"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ArtifactError(
            path, f"unreadable manifest ({error}); export the bundle again"
        ) from error
    if not isinstance(schema, int):
        raise ArtifactError(path, f"schema must be an integer, got {schema!r}", "schema")
    if schema not in READABLE_SCHEMAS:
        newer = schema > max(READABLE_SCHEMAS)
        fix = (
            "upgrade slotserve to a version that reads it, or export the model again with this one"
            if newer
            else "export the model again with this slotserve (`slotserve export`)"
        )
        raise SchemaVersionError(path, schema, READABLE_SCHEMAS, fix)
    try:
        return Manifest.from_json(fields)
    except (KeyError, TypeError, ValueError) as error:
        raise ArtifactError(
            path, f"malformed manifest ({error}); export the bundle again"
        ) from error


def file_identifier(path: Path) -> str:
    """The ExecuTorch format of ``path``: its flatbuffer file identifier, bytes 4..8 (``ET12``
    for a program, ``FT01`` for named data; the flatbuffer's root offset comes first).
    Read before ExecuTorch is asked to load the file (which would fail untyped)."""
    with path.open("rb") as stream:
        head = stream.read(8)
    return head[4:8].decode("ascii", errors="replace") if len(head) == 8 else ""


def check_files(directory: Path, manifest: Manifest) -> None:
    """Every file the manifest names exists and has its recorded SHA-256."""
    for required in (PROGRAM, WEIGHTS, TOKENIZER):
        if required not in manifest.files:
            raise ArtifactError(directory / MANIFEST, f"lists no {required}", "files")
    for name, expected in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(
                path,
                f"missing: the manifest ({directory / MANIFEST}) lists it; copy the whole "
                "bundle directory, or export it again",
            )
        found = file_digest(path)
        if found != expected:
            raise ArtifactError(
                path,
                f"SHA-256 {found[:16]}… but the manifest ({directory / MANIFEST}) records "
                f"{expected[:16]}…: the file is damaged or belongs to another export; copy the "
                "bundle again or export it again",
            )


def check_kv_contract(directory: Path, manifest: Manifest) -> None:
    """The manifest's ``kv_contract`` is the one this runtime keeps: its program's methods
    take and return the step's rows, and the runtime's pool holds the KV."""
    if manifest.kv_contract != KV_CONTRACT:
        raise ArtifactError(
            directory / MANIFEST,
            f"KV contract {manifest.kv_contract!r}, but this runtime keeps {KV_CONTRACT!r}; "
            "export the model again with this slotserve (`slotserve export`)",
            "kv_contract",
        )


TIED_DTYPES = {"float32": 4, "int8": 1}  # what a tied embedding's rows and scales may be


def check_tied_embedding(directory: Path, manifest: Manifest) -> None:
    """A tied embedding's rows (and int8 rows' scales) lie inside the weights file, as
    tensors of a known dtype, ``[vocab, dim]`` and ``[vocab]``."""
    tied = manifest.tied_embedding
    if tied is None:
        return
    where = directory / MANIFEST
    info = manifest.info
    size = (directory / WEIGHTS).stat().st_size
    expected = {"rows": [info.vocab_size, info.dim], "scales": [info.vocab_size]}
    parts = [part for part in ("rows", "scales") if part in tied]
    if "rows" not in parts or set(tied) - set(expected):
        raise ArtifactError(where, f"tied_embedding {sorted(tied)}: expected rows[, scales]")
    for part in parts:
        place = tied[part]
        try:
            offset, dtype, shape = int(place["offset"]), str(place["dtype"]), list(place["shape"])
        except (KeyError, TypeError, ValueError) as error:
            raise ArtifactError(where, f"malformed tied_embedding.{part} ({error})") from error
        if dtype not in TIED_DTYPES or shape != expected[part]:
            raise ArtifactError(
                where,
                f"tied_embedding.{part} is {dtype} {shape}; expected {expected[part]} of "
                f"{' or '.join(TIED_DTYPES)}; export the bundle again",
            )
        end = offset + TIED_DTYPES[dtype] * _product(shape)
        if offset < 0 or end > size:
            raise ArtifactError(
                directory / WEIGHTS,
                f"tied_embedding.{part} (bytes {offset}..{end}) lies outside the file "
                f"({size} bytes) that {where} describes; export the bundle again",
            )


def _product(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total
