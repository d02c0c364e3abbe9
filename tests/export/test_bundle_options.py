"""What the README says a bundle does, each with a test: its load options (``threads``,
the method order) and ``serve --threads``; ``export --backend portable`` exported and run;
the prefix cache on a bundle."""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.artifact import program as program_module
from slotserve.artifact.bundle import MANIFEST, read_bundle
from slotserve.artifact.program import LoadOptions, ProgramHalves
from slotserve.artifact.runtime_threads import default_threads, held_threads
from slotserve.cli import build_parser, main

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture
def thread_pool() -> Iterator[Any]:
    """ExecuTorch's (process-wide) thread pool, put back to its size after the test once
    no program the test loaded holds it (`slotserve.artifact.runtime_threads`)."""
    from executorch.extension.pybindings import portable_lib

    before = portable_lib._threadpool_get_thread_count()
    yield portable_lib
    gc.collect()
    if held_threads() is None and portable_lib._threadpool_get_thread_count() != before:
        portable_lib._unsafe_reset_threadpool(before)


@pytest.fixture
def loaded_methods(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the methods `ProgramHalves` loads, in the order it loads them."""
    names: list[str] = []
    load = program_module._load_method

    def recording(bundle: Any, program: Any, name: str) -> Any:
        names.append(name)
        return load(bundle, program, name)

    monkeypatch.setattr(program_module, "_load_method", recording)
    return names


def test_the_manifest_records_the_load_options(tiny_bundle: Path) -> None:
    manifest = read_bundle(tiny_bundle).manifest
    assert manifest.load_options == {"threads": 0, "load_order": list(manifest.method_names)}
    assert LoadOptions.from_manifest(manifest.load_options) == LoadOptions(0, manifest.method_names)


def test_methods_load_in_the_recorded_order_and_an_override_wins(
    tiny_bundle: Path, tmp_path: Path, loaded_methods: list[str]
) -> None:
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    fields = json.loads((bundle / MANIFEST).read_text())
    recorded = list(reversed(fields["load_options"]["load_order"]))[:3]  # head, then a layer
    fields["load_options"]["load_order"] = recorded  # the manifest is not hashed itself
    (bundle / MANIFEST).write_text(json.dumps(fields))
    ProgramHalves(read_bundle(bundle))
    # The recorded order first, then every other method the manifest lists, once each.
    names = read_bundle(bundle).manifest.method_names
    assert loaded_methods[:3] == recorded
    assert sorted(loaded_methods) == sorted(names)
    loaded_methods.clear()
    ProgramHalves(read_bundle(bundle), load_order=("embed",))
    assert loaded_methods[0] == "embed" and sorted(loaded_methods) == sorted(names)


def test_threads_size_the_runtimes_pool(tiny_bundle: Path, thread_pool: Any) -> None:
    halves = ProgramHalves(read_bundle(tiny_bundle), threads=1)
    assert halves.options.threads == halves.threads == 1
    assert thread_pool._threadpool_get_thread_count() == 1
    del halves
    gc.collect()  # no program holds the pool now
    halves = ProgramHalves(read_bundle(tiny_bundle))  # the manifest's 0: ExecuTorch's own size
    assert halves.threads == thread_pool._threadpool_get_thread_count() == default_threads()


def test_serve_threads_reaches_the_runtime(tiny_bundle: Path, thread_pool: Any) -> None:
    """``serve --threads 1`` as parsed by the command line, through the path that opens
    the model (`model_specs` names the one model, `open_model` opens it)."""
    from slotserve.cli.executors import open_model
    from slotserve.cli.flags import model_specs
    from slotserve.cli.serve import served_name

    args = build_parser().parse_args(["serve", "--model", str(tiny_bundle), "--threads", "1"])
    assert model_specs(args, served_name) is None  # one model: the one-model server
    spec, model, _ = open_model(args)
    assert spec == str(tiny_bundle) and model.halves.kind == "program"
    assert thread_pool._threadpool_get_thread_count() == 1


def test_load_options_are_checked(tiny_bundle: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown load options \['thread'\]"):
        ProgramHalves(read_bundle(tiny_bundle), thread=2)
    with pytest.raises(ValueError, match="threads=-1 must be >= 0"):
        ProgramHalves(read_bundle(tiny_bundle), threads=-1)


def test_a_portable_bundle_exports_and_runs(
    tiny: ss.Model, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """``slotserve export --backend portable``: no delegate, ExecuTorch's portable kernels,
    the eager model's greedy tokens."""
    out = tmp_path / "portable"
    argv = ["export", str(tiny_dirs["llama"]), str(out), "--backend", "portable"]
    assert main([*argv, "--quant", "fp32", "--max-batch-tokens", "32"]) == 0
    bundle = read_bundle(out)
    assert (bundle.manifest.backend, bundle.manifest.delegates) == ("portable", ())
    assert bundle.manifest.max_tokens == 32
    model = ss.load(out)
    assert model.halves.kind == "program"
    config = ss.EngineConfig(max_seqs=2, max_context=64)
    prompts = [[5, 6, 7, 8], list(range(10, 50))]  # the second is prefilled in two steps
    results = {}
    for name, served in (("eager", tiny), ("portable", model)):
        with ss.Engine(served, config) as engine:
            assert engine.config.max_batch_tokens == (32 if name == "portable" else 512)
            results[name] = [engine.submit(p, GREEDY).result().tokens for p in prompts]
            engine.check_integrity()
    assert results["portable"] == results["eager"]


def test_the_prefix_cache_serves_a_bundle(tiny_bundle: Path) -> None:
    """A bundle's steps attend over the engine's pool, so the prefix cache works on it: a
    repeated prefix is restored, not computed, and the tokens are the uncached engine's."""
    model = ss.load(tiny_bundle)
    shared = list(range(10, 42))  # two whole blocks of 16
    prompts = [[*shared, 50], [*shared, 51, 52], [*shared, 50]]
    results = {}
    for cache in ("0", "1MiB"):
        config = ss.EngineConfig(
            max_seqs=2, max_context=128, kv_layout="cell", prefix_cache_bytes=cache
        )
        with ss.Engine(model, config) as engine:
            finals = [engine.submit(p, GREEDY).result() for p in prompts]
            results[cache] = [f.tokens for f in finals]
            cached = [f.usage.cached_tokens for f in finals]
            stats = engine.stats().prefix
            engine.check_integrity()
        if cache == "0":
            assert cached == [0, 0, 0] and stats is None
        else:
            assert cached[0] == 0 and min(cached[1:]) >= len(shared)
            assert stats is not None and stats.hits == 2
            assert stats.tokens_restored >= 2 * len(shared)
    assert results["1MiB"] == results["0"]
