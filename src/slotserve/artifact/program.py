"""A bundle's program as layer halves: its methods run by the ExecuTorch runtime.

Opening a bundle checks it before anything is allocated: the manifest's schema and every
file's SHA-256 (`slotserve.artifact.bundle.read_bundle`); then, before ExecuTorch is asked
to load either file, that the program's and the weights' ExecuTorch formats (their
flatbuffer identifiers, ``ET12`` and ``FT01``) are ones this runtime reads (a
`FormatVersionError`, a `SchemaVersionError`, naming the file, the format, the runtime's
formats and the manifest's ``writer.executorch``); then, in the runtime, that each delegate
the program was lowered for is registered, that the program has every method the manifest
lists, that the program and the weights file carry the same pairing id, and that its
constant methods (context, step size, end tokens, layers, schema) return what the manifest
records. Only then are the methods loaded (this is when XNNPACK packs the weights).
Whatever else makes ExecuTorch refuse a file is an `ArtifactError` too, so
``serve --fallback`` catches every refusal.

The methods are the eager halves lowered (`slotserve.export`): ``embed``, per layer
``layer{i}_qkv`` (before the pool's ``update_and_attend``) and ``layer{i}_out``, and
``head``. The KV stays in slotserve's pool; the methods get the step's activations and return
new rows (the program was lowered with ``alloc_graph_input=False``, so the runtime reads
inputs in place, without a copy). Needs the optional ``executorch`` package.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from typing import Any

import torch

from slotserve.artifact.bundle import (
    CONSTANT_FIELDS,
    MANIFEST,
    PROGRAM,
    WEIGHTS,
    Bundle,
    file_identifier,
)
from slotserve.artifact.runtime_threads import claim_threads
from slotserve.errors import ArtifactError, FormatVersionError
from slotserve.model import Model
from slotserve.model.halves import HalvesKind, StepContext
from slotserve.model.layers import fused_rope_rows
from slotserve.model.weights import LlamaWeights
from slotserve.native import Kernels

log = logging.getLogger("slotserve")


@dataclass(frozen=True)
class LoadOptions:
    """How the runtime loads a bundle: ``threads`` for ExecuTorch's pool, which is one per
    process (`slotserve.artifact.runtime_threads`: a size another loaded bundle holds is
    refused; 0: the held size, else every core), ``load_order`` the order methods are
    loaded in. Defaults come from the manifest's
    ``load_options``; `from_manifest` applies overrides."""

    threads: int = 0
    load_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be >= 0 (0: every core)")

    @classmethod
    def from_manifest(cls, recorded: Mapping[str, Any], **overrides: Any) -> LoadOptions:
        known = {"threads", "load_order"}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown load options {sorted(unknown)}; known: {sorted(known)}")
        merged = {k: v for k, v in recorded.items() if k in known}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return cls(int(merged.get("threads", 0)), tuple(merged.get("load_order", ())))


@dataclass(frozen=True, eq=False, slots=True)
class ProgramStep:
    """One step of `ProgramHalves`: ``cos``, ``sin`` ``[T, (heads + 2·kv_heads)·head_dim]``,
    the step's rotation rows over the fused Q/K/V row (`fused_rope_rows`), which every
    layer's ``qkv`` method takes."""

    cos: torch.Tensor
    sin: torch.Tensor


class ProgramHalves:
    """`slotserve.model.halves.LayerHalves` as a bundle's program methods; ``max_step_tokens``
    is the largest step the program was lowered for."""

    def __init__(self, bundle: Bundle, **load_options: Any) -> None:
        from executorch.runtime import Runtime

        self.bundle = bundle
        manifest = bundle.manifest
        self.options = LoadOptions.from_manifest(manifest.load_options, **load_options)
        check_formats(bundle)
        pte = _check_delegates(bundle)
        self.planned_method_bytes = planned_method_bytes(pte)
        try:
            program = Runtime.get().load_program(bundle.program, data_path=bundle.weights)
        except RuntimeError as error:
            raise ArtifactError(
                bundle.program,
                f"ExecuTorch {executorch_version()} cannot load the {_both(bundle)} ({error}); "
                "export the model again with this runtime's executorch",
            ) from error
        _check_methods(bundle, set(program.method_names))
        _check_pairing(bundle, program)
        _check_constants(bundle, program)
        self.threads = claim_threads(self, self.options.threads, bundle.directory)
        order = self.options.load_order or manifest.method_names
        methods = {name: _load_method(bundle, program, name) for name in order}
        for name in manifest.method_names:
            if name not in methods:
                methods[name] = _load_method(bundle, program, name)
        self.info = bundle.info
        self._max_step_tokens = manifest.max_tokens
        layers = range(manifest.info.n_layers)
        self._embed = methods["embed"]
        self._tied = map_tied_embedding(bundle)  # the head's weights, for a tied embedding
        self._qkv = [methods[f"layer{i}_qkv"] for i in layers]
        self._out = [methods[f"layer{i}_out"] for i in layers]
        self._head = methods["head"]
        self._head_rows = int(self._head.metadata.input_tensor_meta(0).sizes()[0])
        self._program = program  # methods borrow from it

    @property
    def kind(self) -> HalvesKind:
        return "program"

    @property
    def weights(self) -> LlamaWeights | None:
        return None  # they live in the program's weights file

    @property
    def weight_bytes(self) -> int:
        return self.bundle.resident_bytes

    @property
    def mapped_weight_bytes(self) -> int:
        """The tied embedding's tables, mapped from the weights file (`map_tied_embedding`):
        not resident at load, they become so as ``embed`` looks rows up, beside the head's
        packed copy. Prompts of many distinct tokens make a table nearly whole resident,
        so the plan's weights count them in full (`slotserve.load`)."""
        return sum(table.nbytes for table in self._tied)

    @property
    def max_step_tokens(self) -> int | None:
        return self._max_step_tokens

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() > self._max_step_tokens:
            raise ValueError(
                f"a step of {tokens.numel()} tokens exceeds the {self._max_step_tokens} the "
                f"program was lowered for; serve with --max-batch-tokens "
                f"{self._max_step_tokens} or export again with a larger --max-batch-tokens"
            )
        (x,) = self._embed.execute([tokens.to(torch.long).contiguous(), *self._tied])
        return x  # type: ignore[no-any-return]

    def begin_step(self, context: StepContext) -> ProgramStep:
        """The step's rotation rows laid over the fused Q/K/V row, as the ``layer{i}_qkv``
        methods take them (`fused_rope_rows`)."""
        return ProgramStep(*fused_rope_rows(self.info, context.cos, context.sin))

    def end_step(self, step: ProgramStep) -> None:
        pass  # nothing held beyond the step's rows

    def qkv(self, layer: int, x: torch.Tensor, step: ProgramStep) -> torch.Tensor:
        (rows,) = self._qkv[layer].execute([x, step.cos, step.sin])
        return rows  # type: ignore[no-any-return]

    def out(
        self, layer: int, x: torch.Tensor, attn: torch.Tensor, step: ProgramStep
    ) -> torch.Tensor:
        (y,) = self._out[layer].execute([x, attn.contiguous()])
        return y  # type: ignore[no-any-return]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The head in calls of at most the rows it was lowered for (a bundle's head takes
        fewer rows than a step: its logits are memory planned at load)."""
        chunks = [
            self._head.execute([rows.contiguous()])[0] for rows in torch.split(x, self._head_rows)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def map_tied_embedding(bundle: Bundle) -> tuple[torch.Tensor, ...]:
    """A tied embedding's tables (the head's rows, and their scales for int8 rows), mapped
    read-only from the weights file where the manifest says they are (`read_bundle`
    checked the places): the ``embed`` method reads them in place, so only the pages of the
    rows it looks up are read, beside the head's packed weights (varied input reads them
    all: `ProgramHalves.mapped_weight_bytes`). Empty for a bundle whose ``embed`` holds its
    own table."""
    import numpy as np

    tied = bundle.manifest.tied_embedding
    if tied is None:
        return ()
    tables = []
    for part in ("rows", "scales"):
        if part in tied:
            place = tied[part]
            # Copy-on-write: a writable array (torch wants one) that never writes the file;
            # its pages are the file's until written, and the method only reads them.
            array = np.memmap(
                bundle.weights,
                dtype=np.dtype(place["dtype"]),
                mode="c",
                offset=int(place["offset"]),
                shape=tuple(place["shape"]),
            )
            tables.append(torch.from_numpy(array))
    return tuple(tables)


def open_bundle(bundle: Bundle, kernels: Kernels, **load_options: Any) -> Model:
    """The bundle's `Model`: its program's halves (checked, loaded), its tokenizer, and the
    attention kernel of ``kernels`` for the pool (the KV stays in slotserve's pool)."""
    halves = ProgramHalves(bundle, **load_options)
    return Model(bundle.info, bundle.tokenizer, halves, str(bundle.directory), kernels)


def _both(bundle: Bundle) -> str:
    return f"program {bundle.program} with weights {bundle.weights}"


# The formats' two-letter prefixes: a file without its kind's is no ExecuTorch file of it.
_FORMATS = {PROGRAM: ("program", "ET"), WEIGHTS: ("weights", "FT")}


def executorch_version() -> str:
    try:
        return metadata.version("executorch")
    except metadata.PackageNotFoundError:
        return "unknown"


@cache
def runtime_formats() -> dict[str, tuple[str, ...]]:
    """The ExecuTorch formats this runtime reads, by bundle file: the file identifiers of the
    flatbuffer schemas the installed executorch was built from (``program.fbs``: ``ET12``;
    ``flat_tensor.fbs``: ``FT01``). A file whose schema is not found is not checked here
    (ExecuTorch's own refusal is still an `ArtifactError`)."""
    schemas = {
        PROGRAM: ("executorch.exir._serialize", "program.fbs"),
        WEIGHTS: ("executorch.extension.flat_tensor.serialize", "flat_tensor.fbs"),
    }
    formats: dict[str, tuple[str, ...]] = {}
    for name, (package, schema) in schemas.items():
        try:
            text = (resources.files(package) / schema).read_text()
        except (ModuleNotFoundError, FileNotFoundError) as error:
            log.warning("cannot read executorch's %s (%s): %s not checked", schema, error, name)
            continue
        formats[name] = tuple(re.findall(r'file_identifier\s+"([^"]{4})"', text))
    return formats


def check_formats(bundle: Bundle) -> None:
    """The program's and the weights' ExecuTorch formats are ones this runtime reads, and
    the manifest's ``writer.executorch`` is compared with this runtime: another version is
    read when its formats are (and logged), and refused, with both versions in the fix, when
    they are not. Reads each file's first 8 bytes only, before ExecuTorch loads anything."""
    runtime = executorch_version()
    writer = bundle.manifest.writer.get("executorch", "unknown")
    formats = runtime_formats()
    for name, (what, prefix) in _FORMATS.items():
        path = bundle.directory / name
        found = file_identifier(path)
        readable = formats.get(name)
        if not readable or found in readable:
            continue
        if not found.startswith(prefix):
            raise ArtifactError(
                path,
                f"not an ExecuTorch {what} file (its header reads {found!r}, where an "
                f"ExecuTorch {what} file reads {readable[0]}); export the model again",
                "format",
            )
        fix = f"export the model again with executorch {runtime}"
        if writer not in (runtime, "unknown"):
            fix = (
                f"the bundle was written by executorch {writer} ({bundle.directory / MANIFEST}"
                f"); {fix}, or serve it with executorch {writer}"
            )
        raise FormatVersionError(path, what, found, readable, runtime, fix)
    if writer != runtime:
        log.info(
            "%s was written by executorch %s; this runtime (executorch %s) reads its formats",
            bundle.directory,
            writer,
            runtime,
        )


def planned_method_bytes(pte: Any) -> int:
    """The memory ExecuTorch plans for the program's methods: one set of arenas that every
    method shares, each arena (memory id) as large as the largest method's. The runtime
    (executorch 1.5's ``Program.load_method``) gives every host-only method the same
    arenas, sized to the largest, and copies outputs out of them, so running every method
    one after another grows the resident set by the largest method's arenas, not by their
    sum. Entry 0 of each method's list is reserved and 0. Delegates' own scratch
    (XNNPACK's workspace) is not in it."""
    arenas: dict[int, int] = {}
    for plan in pte.program.execution_plan:
        for memory_id, size in enumerate(plan.non_const_buffer_sizes):
            arenas[memory_id] = max(arenas.get(memory_id, 0), size)
    return sum(arenas.values())


def _check_delegates(bundle: Bundle) -> Any:
    """Every backend the program was lowered for is registered in this runtime. Read from the
    program itself, not only the manifest: a delegate with no runtime fails much later and
    much less clearly ("missing delegate data")."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.extension.pybindings.portable_lib import _get_registered_backend_names

    try:
        pte = deserialize_pte_binary(bundle.program.read_bytes())
    except Exception as error:  # a damaged flatbuffer fails in any of its readers' ways
        raise ArtifactError(
            bundle.program,
            f"unreadable ExecuTorch program ({type(error).__name__}: {error}); export the "
            "model again",
        ) from error
    lowered_for = {d.id for plan in pte.program.execution_plan for d in plan.delegates}
    lowered_for |= set(bundle.manifest.delegates)
    available = set(_get_registered_backend_names())
    missing = sorted(lowered_for - available)
    if missing:
        raise ArtifactError(
            bundle.program,
            f"lowered for {', '.join(missing)}, which this runtime does not have (it has "
            f"{', '.join(sorted(available)) or 'no delegates'}); export the model again with "
            "--backend xnnpack or --backend portable",
            "delegates",
        )
    return pte


def _check_methods(bundle: Bundle, present: set[str]) -> None:
    info = bundle.manifest.info
    needed = {"embed", "head", "weights_id", "get_pair_id", *CONSTANT_FIELDS}
    needed |= {f"layer{i}_{half}" for i in range(info.n_layers) for half in ("qkv", "out")}
    missing = sorted((needed | set(bundle.manifest.method_names)) - present)
    if missing:
        raise ArtifactError(
            bundle.program,
            f"missing method(s) {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''} "
            f"that {bundle.directory / MANIFEST} and this runtime need; export the model again",
            "methods",
        )


def _check_pairing(bundle: Bundle, program: Any) -> None:
    """The program's pairing id (a constant method, in the program) equals the weights' (a
    tensor, in the weights file) and the manifest's."""
    expected = bytes.fromhex(bundle.manifest.pair_id)
    try:
        in_program = bytes(program.load_method("get_pair_id").execute([]))
        (stored,) = program.load_method("weights_id").execute([])
        in_weights = bytes(stored.tolist())
    except (RuntimeError, ValueError) as error:
        raise ArtifactError(
            bundle.weights,
            f"the {_both(bundle)} cannot be read together ({error}); they are not from the same "
            "export: copy the bundle again or export it again",
            "pair_id",
        ) from error
    if not expected == in_program == in_weights:
        raise ArtifactError(
            bundle.weights,
            f"the {_both(bundle)} are from different exports (pairing ids {in_program.hex()[:8]}"
            f" and {in_weights.hex()[:8]}, manifest {expected.hex()[:8]}); use the weights "
            "file exported with this program",
            "pair_id",
        )


def _check_constants(bundle: Bundle, program: Any) -> None:
    """Each constant method returns what the manifest records (`Manifest.constants`): the
    runtime serves by the manifest (its context, step size, end tokens, layer count), so a
    program that says otherwise is not the program the manifest describes."""
    for name, recorded in bundle.manifest.constants.items():
        expected = recorded if isinstance(recorded, list) else [recorded]
        try:
            found = list(program.load_method(name).execute([]))
        except (RuntimeError, ValueError) as error:
            raise ArtifactError(
                bundle.program, f"constant method {name} cannot be read ({error})", name
            ) from error
        if found != expected:
            shown = found if len(found) != 1 else found[0]
            raise ArtifactError(
                bundle.program,
                f"{name}() returns {shown!r}, but {bundle.directory / MANIFEST} records "
                f"{CONSTANT_FIELDS[name]} = {recorded!r}: the manifest does not describe this "
                "program; export the model again (or restore the manifest exported with it)",
                name,
            )


def _load_method(bundle: Bundle, program: Any, name: str) -> Any:
    try:
        return program.load_method(name)
    except RuntimeError as error:
        raise ArtifactError(
            bundle.program, f"method {name} failed to load with {bundle.weights}: {error}"
        ) from error
