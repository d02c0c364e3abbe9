"""Reading model files: GGUF (gguf-py + dequantisation), Hugging Face safetensors
directories, slotserve's exported bundles, the bundled default model; the tokenizer and chat
template.

`load(spec)` is the one entry point; it returns a `slotserve.model.Model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from slotserve.artifact.bundle import is_bundle, read_bundle
from slotserve.artifact.bundled import bundled_gguf_path
from slotserve.artifact.gguf_file import has_block_matrices
from slotserve.artifact.gguf_load import load_gguf
from slotserve.artifact.hf import load_hf_dir
from slotserve.artifact.named import NAMED_MODELS, model_path
from slotserve.artifact.program import open_bundle
from slotserve.errors import ArtifactError
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.memory import (
    LoadMemory,
    TokenizerMark,
    code_resident_bytes,
    peak_rss_bytes,
    release_code_pages,
    reset_peak_rss,
    rss_bytes,
    trim_heap,
)
from slotserve.model import Model
from slotserve.model.quantized import with_weights
from slotserve.native import (
    KernelChoice,
    Kernels,
    build_kernels,
    dedicate_cores_to_kernels,
)
from slotserve.native.threads import on_own_thread
from slotserve.sampling import COSTLIEST_SAMPLING, RequestSampler, token_logprobs

WEIGHT_CHOICES = ("auto", "gguf", "fp32", "int8")


def load(
    spec: str | Path,
    *,
    progress: bool = True,
    weights: str = "auto",
    kernels: KernelChoice = "auto",
    bundle_threads: int | None = None,
) -> Model:
    """Load a model: a named one (``"bundled"``, ``"gemma3-270m"``: `NAMED_MODELS`), a
    ``.gguf`` path, a Hugging Face model directory, or a
    bundle directory (`slotserve export`). A bundle's checks run here (schema, files, then
    the program's methods, delegates and pairing), and its layers are its program's methods.

    ``weights`` is how a GGUF file's or an HF directory's weights are held:
    ``"gguf"`` keeps a GGUF file's Q4_0/Q4_1/Q8_0 matrices as its blocks, multiplied by a
    compiled kernel with llama.cpp's arithmetic (`slotserve.model.gguf_linear`: the file's
    size resident, and the fastest decode); ``"fp32"`` dequantises everything;
    ``"int8"`` quantises fp32 projections per channel (`slotserve.model.quantized`).
    ``"auto"`` (the default) is ``"gguf"`` for a GGUF file with such matrices where the
    kernel builds, else ``"fp32"``.

    ``kernels`` (`slotserve.native.build_kernels`): ``"auto"`` builds the C kernels for this
    machine (once; logged), ``"off"`` runs torch ops only. The model's layer halves are
    picked once, here, and logged (``model.halves.kind``). With kernel-backed weights, torch's
    own ops get one thread (`slotserve.native.threads`: the kernels' threads keep the cores).
    ``bundle_threads`` sizes ExecuTorch's thread pool for a bundle (default: its manifest's
    load option).

    ``model.load_memory`` is what the load did to the process (`slotserve.memory.LoadMemory`):
    its resident set before and after, what the tokenizer added before the weights were
    read, and its peak during the load (measured by resetting the process's peak resident
    set, Linux's VmHWM, when the load starts).
    """
    built = build_kernels(kernels)
    weights = weight_format(spec, weights, built)
    # The code only the imports ran leaves the resident set before the runtime arena is
    # measured; what steps run faults back in at the first step and the largest, which
    # count it (`release_code_pages`).
    release_code_pages()
    # The load's own peak (its transient copies) is measured from here: the process's peak
    # resident set starts again (`reset_peak_rss`).
    peak_measured = reset_peak_rss()
    runtime = rss_bytes()  # the runtime arena: what the process holds before the model
    runtime_code = code_resident_bytes()
    tokenizer_read = TokenizerMark()
    if weights == "gguf":
        if built.blocks is None:
            state = "off" if kernels == "off" else "not built (see the warning above)"
            raise ValueError(
                f"weights='gguf' needs the block kernel, which is {state}; load with weights='fp32'"
            )
        # Before any torch work of the load: a parallel torch op starts an OpenMP team on
        # this thread that outlives it (see slotserve.native.threads). Only this path
        # returns block weights.
        dedicate_cores_to_kernels()
        path = _gguf_path(spec)
        model = load_gguf(
            path, progress=progress, blocks=True, kernels=built, tokenizer_read=tokenizer_read
        )
    else:
        model = _load(spec, progress, built, bundle_threads, tokenizer_read)
        if weights != "fp32":
            if model.weights is None:
                raise ValueError(f"weights={weights!r}: a bundle's weights were fixed at export")
            quantised = with_weights(model.weights, weights)
            model = Model.from_weights(model.info, model.tokenizer, quantised, model.source, built)
    peak = peak_rss_bytes() if peak_measured else 0
    trim_heap()  # the load's freed temporaries leave the resident set
    loaded = rss_bytes()
    # The code the load ran is runtime: how much of it is resident is the page cache's doing.
    load_code = max(code_resident_bytes() - runtime_code, 0)
    if peak_measured:  # VmHWM lags the resident set by the pages of its last faults
        peak = max(peak, loaded)
    first_step = _first_step_bytes(model, loaded)
    methods = _largest_step_bytes(model, loaded + first_step)
    tokenizer_code = max(tokenizer_read.code_bytes - runtime_code, 0)
    tokenizer = max((tokenizer_read.rss_bytes or runtime) - runtime - tokenizer_code, 0)
    model.load_memory = LoadMemory(runtime, loaded, peak, first_step, methods, tokenizer, load_code)
    return model


def _first_step_bytes(model: Model, loaded: int) -> int:
    """Run one token through ``model``, and draw from its logits as the costliest sampling
    does, and return what the process kept: the first step's one-time state (thread pools,
    lazily built tables, the math libraries' own set-up and the pages of their code),
    measured at 5.6-5.8 MiB on the bundled model without the draw and 13.8 MiB with it (a
    Xeon: the draw's sort and multinomial code). It is runtime, not a step's transient
    memory: without this step it would land on whichever step ran first, and the plan
    would count it nowhere."""
    first = model.info.bos_id or 0
    sampler = RequestSampler(COSTLIEST_SAMPLING, model.info.vocab_size, [first])
    # Model.logits runs on a thread of its own: no kernel team is left on this one.
    with torch.inference_mode():
        (row,) = model.logits([first])
        token_logprobs(row, sampler.sample(row), COSTLIEST_SAMPLING.logprobs or 0)
    del sampler
    trim_heap()
    return max(rss_bytes() - loaded, 0)


def _largest_step_bytes(model: Model, before: int) -> int:
    """For a bundle, run the largest step its methods take (``max_step_tokens`` rows, in as
    few sequences as its context allows, on a scratch pool) and return what the process
    kept beyond ``before``: the methods' shared planned arenas as that step writes them and
    the delegates' scratch for its rows (XNNPACK's workspace), which grows with the rows
    and stays. Measured on the bundled model's 8da4w bundle after a 512-token step: 13.6
    MiB, where its planned arenas are 6.0 MiB. Before this, the first such step landed in a
    server's start (its cancellation bound) outside every arena. 0 for halves that are not
    a program."""
    rows = model.halves.max_step_tokens
    if model.halves.kind != "program" or not rows:
        return 0
    context = min(rows, model.info.max_context)  # as many sequences as the rows need
    lengths = [context] * (rows // context) + ([rows % context] if rows % context else [])

    def step() -> None:  # its pool and activations are gone when it returns
        config = KVConfig(layout="flat", max_seqs=len(lengths), max_context=context)
        kv = KVPool(model.info, config, attention=model.kernels.attention)
        for session, length in enumerate(lengths):
            kv.reserve(session, length)
        batch = StepBatch(list(range(len(lengths))), [0] * len(lengths), lengths)
        kv.begin_step(batch)
        with torch.inference_mode():
            model.forward(torch.full((rows,), model.info.bos_id or 0), batch, kv)

    on_own_thread(step)  # no kernel team left on this thread
    trim_heap()
    return max(rss_bytes() - before, 0)


def weight_format(spec: str | Path, weights: str = "auto", kernels: Kernels | None = None) -> str:
    """The format `load` holds ``spec``'s weights in for ``weights`` (which resolves
    ``"auto"``: GGUF blocks where the file has them and ``kernels`` has the block kernel),
    without loading them."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHT_CHOICES}")
    if weights != "auto":
        return weights
    has_kernel = kernels is not None and kernels.blocks is not None
    return "gguf" if has_kernel and _has_block_matrices(spec) else "fp32"


def _has_block_matrices(spec: str | Path) -> bool:
    path = model_path(spec)
    return path.suffix == ".gguf" and path.is_file() and has_block_matrices(path)


def _gguf_path(spec: str | Path) -> Path:
    path = model_path(spec)
    if path.suffix != ".gguf":
        raise ValueError(f"weights='gguf' keeps a GGUF file's blocks; {str(spec)!r} is not one")
    return path


def _load(
    spec: str | Path,
    progress: bool,
    kernels: Kernels,
    bundle_threads: int | None,
    tokenizer_read: TokenizerMark,
) -> Model:
    path = model_path(spec)
    if is_bundle(path):
        bundle = read_bundle(path)  # its manifest and tokenizer; the program's weights next
        tokenizer_read()
        return open_bundle(bundle, kernels, threads=bundle_threads)
    if path.is_dir():
        return load_hf_dir(path, kernels, tokenizer_read)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, progress=progress, kernels=kernels, tokenizer_read=tokenizer_read)
    raise ArtifactError(
        path,
        f"no such model; pass one of {tuple(NAMED_MODELS)}, a .gguf file or a Hugging Face "
        "model directory",
    )


__all__ = [
    "NAMED_MODELS",
    "WEIGHT_CHOICES",
    "bundled_gguf_path",
    "is_bundle",
    "load",
    "load_gguf",
    "load_hf_dir",
    "model_path",
    "read_bundle",
]
