"""`export_bundle`: write a model as a bundle (`slotserve.artifact.bundle`) of an ExecuTorch
program, its weights as a separate file, the tokenizer and a manifest.

Stages (each timed and reported): build the method modules (`slotserve.export.program`),
`torch.export` each with a dynamic token count, tag every weight as external data, lower
(XNNPACK, or the portable kernels), serialise ``program.pte`` and ``weights.ptd``, find where
the head's weights lie in it when a tied embedding reads them (`Manifest.tied_embedding`),
then write the manifest last, so a directory with a manifest is a complete bundle.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from slotserve.artifact.bundle import (
    MANIFEST,
    PROGRAM,
    TIED_EMBEDDING_SCHEMA,
    TOKENIZER,
    WEIGHTS,
    WEIGHTS_TAG,
    Manifest,
    MethodSpec,
    constant_methods,
    is_bundle,
)
from slotserve.artifact.weight_cache import file_digest
from slotserve.export.program import (
    QKV,
    Embed,
    Head,
    Out,
    PairId,
    TiedEmbed,
    TwoPass,
    check_supported,
    dense_embedding,
    dense_linear,
    dense_linears,
    head_weight,
    in_two_passes,
    int4_linears,
    int8_rows_linear,
    tied_rows,
)
from slotserve.model import Model

Backend = Literal["xnnpack", "portable"]
Quant = Literal["fp32", "8da4w", "8da4w-2pass"]
QUANTS: tuple[Quant, ...] = ("fp32", "8da4w", "8da4w-2pass")
# The head takes each sequence's last row: at most this many a call (the executor splits a
# larger step). Its logits are planned memory of the method, allocated at load and resident
# for the bundle's life, in proportion to this bound (rows x vocabulary x 4 bytes).
HEAD_ROWS = 32
Progress = Callable[[str], None]
DELEGATE_IDS: dict[str, tuple[str, ...]] = {"xnnpack": ("XnnpackBackend",), "portable": ()}


@dataclass(frozen=True)
class ExportOptions:
    """``backend``: ``xnnpack`` (XNNPACK kernels) or ``portable`` (ExecuTorch's portable
    kernels, fp32 only). ``quant``: ``fp32``, or ``8da4w`` (int4 weights in groups of 32: the
    blocks of a Q4_0/Q4_1 GGUF loaded with them kept exactly; int8 rows for the head, int8
    blocks for an untied embedding, and the head's rows for a tied one; int8 dynamic
    activations per token), or ``8da4w-2pass`` (the
    same, with every projection and the head in two passes, `TwoPass`: as close to llama.cpp
    as the fp32 model, for longer decode steps; `slotserve export`'s default;
    docs/EXECUTORCH-NOTES.md).
    ``max_tokens``: the largest step (decode tokens plus a prefill chunk) the methods take;
    ``max_context``: the longest sequence the bundle serves (default: the model's).
    ``threads``: the load option recorded for the runtime (0: every core)."""

    backend: Backend = "xnnpack"
    quant: Quant = "fp32"
    max_tokens: int = 512
    max_context: int | None = None
    threads: int = 0

    def __post_init__(self) -> None:
        if self.backend not in DELEGATE_IDS:
            raise ValueError(f"backend={self.backend!r}; choose xnnpack or portable")
        if self.quant not in QUANTS:
            raise ValueError(f"quant={self.quant!r}; choose one of {', '.join(QUANTS)}")
        if self.quant != "fp32" and self.backend != "xnnpack":
            raise ValueError(f"quant={self.quant} runs on XNNPACK's kernels: use backend=xnnpack")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context={self.max_context} must be >= 1")
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be >= 0 (0: every core)")


def load_for_export(spec: str | Path, progress: bool = True) -> Model:
    """``spec`` loaded as export reads it: a GGUF file with its blocks (``8da4w`` stores its
    Q4 blocks exactly; ``fp32`` dequantises them), read once and without building or
    running any kernel (export only reads the weights, and leaves torch's threads alone for
    lowering); any other model in fp32."""
    from slotserve.artifact import load, load_gguf, model_path

    path = model_path(spec)
    if path.suffix == ".gguf":
        return load_gguf(path, progress=progress, blocks=True)
    return load(spec, progress=progress, weights="fp32", kernels="off")


def export_bundle(
    model: Model, out: Path, options: ExportOptions, progress: Progress | None = None
) -> Manifest:
    """Write ``model`` as a bundle in the directory ``out`` (replaced if it holds a bundle)."""
    say = progress or (lambda message: None)
    check_supported(model)  # before anything is built
    if out.exists() and not is_bundle(out) and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not a bundle; export into a new directory")
    info = model.info
    max_context = options.max_context or info.max_context
    if max_context > info.max_context:
        raise ValueError(
            f"max_context={max_context} exceeds the model's context {info.max_context}"
        )
    pair_id = secrets.token_bytes(16)
    began = time.monotonic()
    modules = _modules(model, options, pair_id)
    schema = TIED_EMBEDDING_SCHEMA if isinstance(modules["embed"][0], TiedEmbed) else 1
    say(f"built {len(modules)} methods ({options.quant}) in {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    programs = {
        name: _export(named(name, module, len(inputs)), inputs, _static_inputs(module))
        for name, (module, inputs) in modules.items()
    }
    say(f"exported {len(programs)} methods in {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    constants = _constant_methods(model, options, max_context, pair_id, schema)
    program = _lower(programs, options, constants)
    say(f"lowered to {options.backend} in {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with (staging / PROGRAM).open("wb") as stream:
        program.write_to_file(stream)
    program.write_tensor_data_to_file(str(staging))
    if not (staging / WEIGHTS).is_file():
        raise RuntimeError(f"ExecuTorch wrote no {WEIGHTS} in {staging}")
    (staging / TOKENIZER).write_text(model.tokenizer.to_json())
    tied = _tied_embedding(modules, staging / WEIGHTS)
    manifest = _manifest(model, options, max_context, pair_id, modules, staging, tied)
    (staging / MANIFEST).write_text(manifest.to_json())
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)
    sizes = ", ".join(
        f"{name} {(out / name).stat().st_size / 2**20:.1f} MiB" for name in (PROGRAM, WEIGHTS)
    )
    say(f"wrote {out} ({sizes}) in {time.monotonic() - began:.1f} s")
    return manifest


def _manifest(
    model: Model,
    options: ExportOptions,
    max_context: int,
    pair_id: bytes,
    modules: dict[str, tuple[nn.Module, Inputs]],
    directory: Path,
    tied_embedding: dict[str, Any] | None,
) -> Manifest:
    """The manifest of the files written in ``directory`` (the oldest schema that describes
    them: 1, or `TIED_EMBEDDING_SCHEMA` for an embedding read from the head's weights)."""
    info = model.info
    source = Path(model.source)
    schema = TIED_EMBEDDING_SCHEMA if tied_embedding else 1
    return Manifest(
        schema=schema,
        writer={"slotserve": _version("slotserve"), "executorch": _version("executorch")},
        model={
            "name": info.name,
            "source": source.name,
            "source_path": str(source.resolve()),
            "source_sha256": file_digest(source) if source.is_file() else "",
        },
        info=info,
        backend=options.backend,
        delegates=DELEGATE_IDS[options.backend],
        quant=options.quant,
        max_tokens=options.max_tokens,
        max_context=max_context,
        methods=tuple(_method_spec(name, modules[name]) for name in modules),
        pair_id=pair_id.hex(),
        files={name: file_digest(directory / name) for name in (PROGRAM, WEIGHTS, TOKENIZER)},
        load_options={"threads": options.threads, "load_order": list(modules)},
        tied_embedding=tied_embedding,
        readable_by=(schema,),
    )


Inputs = tuple[torch.Tensor, ...]


def _modules(
    model: Model, options: ExportOptions, pair_id: bytes
) -> dict[str, tuple[nn.Module, Inputs]]:
    """Each method's module and example inputs (at the largest size: an input the runtime reads
    in place keeps its example size as its capacity; distinct tensors, since export merges
    example inputs that are the same object)."""
    weights = check_supported(model)
    info, tokens = model.info, options.max_tokens
    quantised = options.quant != "fp32"
    two_passes = options.quant == "8da4w-2pass"
    linears = int4_linears(weights, info, model.source) if quantised else dense_linears(weights)
    if two_passes:
        linears = in_two_passes(linears)
    width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    head_weights = head_weight(weights)
    head_linear = int8_rows_linear(head_weights) if quantised else dense_linear(head_weights)
    token_ids = torch.zeros(tokens, dtype=torch.long)
    # A tied embedding is the head's weights, stored once: the embed method reads them as
    # inputs the runtime maps from weights.ptd (`TiedEmbed`), not as a second table.
    embed: tuple[nn.Module, Inputs] = (
        (TiedEmbed(quantised), (token_ids, *tied_rows(head_linear).tensors))
        if weights.tied
        else (Embed(dense_embedding(weights), quantised), (token_ids,))
    )
    modules: dict[str, tuple[nn.Module, Inputs]] = {"embed": embed}
    for i, layer in enumerate(weights.layers):
        qkv = QKV(info, layer.attn_norm, linears(i, "qkv"))
        rope = (
            torch.randn(tokens, info.dim),
            torch.randn(tokens, width),
            torch.randn(tokens, width),
        )
        modules[f"layer{i}_qkv"] = (qkv, rope)
        out = Out(
            info,
            layer.mlp_norm,
            linears(i, "o"),
            linears(i, "gate"),
            linears(i, "up"),
            linears(i, "down"),
        )
        attn = torch.randn(tokens, info.n_heads * info.head_dim)
        modules[f"layer{i}_out"] = (out, (torch.randn(tokens, info.dim), attn))
    head = Head(info, weights.norm, TwoPass(head_linear) if two_passes else head_linear)
    modules["head"] = (head, (torch.randn(min(tokens, HEAD_ROWS), info.dim),))
    modules["weights_id"] = (PairId(pair_id), ())
    return modules


class Named(nn.Module):
    """``module`` under the attribute ``name``: its weights' names (``layer3_qkv.norm``) are
    their keys in the shared weights file, so they must be unique across methods (the same
    ``norm`` in two methods would be one entry, silently shared). One subclass per arity:
    ``torch.export`` wants a forward with named tensor arguments."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.method = name
        self.add_module(name, module)

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = getattr(self, self.method)(*inputs)
        return result


class _Named0(Named):
    def forward(self) -> torch.Tensor:
        return self.run()


class _Named1(Named):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.run(a)


class _Named2(Named):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.run(a, b)


class _Named3(Named):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.run(a, b, c)


def named(name: str, module: nn.Module, arity: int) -> Named:
    kinds: tuple[type[Named], ...] = (_Named0, _Named1, _Named2, _Named3)
    return kinds[arity](name, module)


def _static_inputs(module: nn.Module) -> tuple[int, ...]:
    """The inputs of a method module whose shape is fixed (a `TiedEmbed`'s table); every
    other input's first axis is the step's token count."""
    static: tuple[int, ...] = getattr(module, "static_inputs", ())
    return static


def _export(module: nn.Module, inputs: Inputs, static: tuple[int, ...] = ()) -> Any:
    """``torch.export`` with the first axis of every input not in ``static`` dynamic (the
    weights are tagged as external data later, on the edge graph: `_tag_weights`)."""
    from torch.export import Dim, export

    tokens = Dim("tokens", min=1, max=max(2, inputs[0].shape[0])) if inputs else None
    shapes = (
        tuple(None if i in static else {0: tokens} for i in range(len(inputs))) if inputs else None
    )
    with torch.no_grad():
        return export(module.eval(), inputs, dynamic_shapes=shapes)


def _lower(programs: dict[str, Any], options: ExportOptions, constants: dict[str, Any]) -> Any:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    partitioners: list[Any] = []
    if options.backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )

        partitioners = [XnnpackPartitioner()]
    edge = to_edge_transform_and_lower(
        programs,
        transform_passes=[_tag_weights],
        partitioner=partitioners,
        constant_methods=constants,
    )
    config = ExecutorchBackendConfig(
        # Inputs are not copied into planned memory: the runtime reads the caller's tensors.
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        external_constants=lambda node: WEIGHTS_TAG,
    )
    return edge.to_executorch(config)


def _tag_weights(graph: torch.fx.GraphModule) -> None:
    """Mark every graph input as weights-file data for the delegates, on the edge graph about
    to be partitioned (ExecuTorch's own pass tags the module before export, but that tag does
    not survive the unwrapping of torchao's quantised tensors into int8 data and scales). A
    delegate stores only constants, so the tag on activation inputs is never used."""
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = WEIGHTS_TAG


def _constant_methods(
    model: Model, options: ExportOptions, max_context: int, pair_id: bytes, schema: int
) -> dict[str, Any]:
    """ExecuTorch's runner metadata and the bundle's schema (`constant_methods`, which the
    runtime compares with the manifest at load), and the pairing id."""
    constants = constant_methods(model.info, options.max_tokens, max_context, schema)
    return {**constants, "get_pair_id": list(pair_id)}


def _method_spec(name: str, entry: tuple[nn.Module, Inputs]) -> MethodSpec:
    module, inputs = entry
    static = _static_inputs(module)
    with torch.no_grad():
        outputs = module(*inputs)

    def shape(tensor: torch.Tensor, dynamic: bool) -> tuple[str | int, ...]:
        return tuple(
            ("T" if dynamic and axis == 0 else size) for axis, size in enumerate(tensor.shape)
        )

    dynamic = bool(inputs)
    return MethodSpec(
        name,
        tuple(shape(t, dynamic and i not in static) for i, t in enumerate(inputs)),
        (shape(outputs, dynamic),),
        tuple(str(t.dtype).removeprefix("torch.") for t in (*inputs, outputs)),
    )


def _tied_embedding(
    modules: dict[str, tuple[nn.Module, Inputs]], weights: Path
) -> dict[str, Any] | None:
    """Where in ``weights`` the head's weights that a `TiedEmbed` reads are stored: each
    tensor's byte offset, dtype and shape (None for a model whose embedding is its own)."""
    module, inputs = modules["embed"]
    if not isinstance(module, TiedEmbed):
        return None
    found = _locate_tensors(weights, inputs[1:])
    return dict(zip(("rows", "scales"), found, strict=False))


def _locate_tensors(path: Path, tensors: Inputs) -> list[dict[str, Any]]:
    """Each tensor's place in the ExecuTorch named-data file ``path``: the segment holding
    exactly its bytes (ExecuTorch stores one segment for identical data)."""
    from executorch.extension.flat_tensor.serialize.serialize import (
        _deserialize_to_flat_tensor,
        _get_extended_header,
    )

    with path.open("rb") as stream:
        head = stream.read(4096)
        header = _get_extended_header(head)
        if header is None:
            raise RuntimeError(f"{path} has no flat tensor header")
        stream.seek(0)
        flat = _deserialize_to_flat_tensor(
            stream.read(header.flatbuffer_offset + header.flatbuffer_size)
        )
        places = []
        for tensor in tensors:
            data = tensor.contiguous().numpy().tobytes()
            for segment in flat.segments:
                if int(segment.size) != len(data):
                    continue
                offset = header.segment_base_offset + int(segment.offset)
                stream.seek(offset)
                if stream.read(len(data)) == data:
                    break
            else:
                raise RuntimeError(
                    f"the head's weights ({tuple(tensor.shape)} {tensor.dtype}) are not in "
                    f"{path}: the tied embedding cannot be read from them"
                )
            places.append(
                {
                    "offset": offset,
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                }
            )
    return places


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"
