"""Bundles on the real ExecuTorch runtime: what `export_bundle` writes, and the executor that
serves it through the engine.

The fp32 bundle must give the eager model's logits (to float rounding) and its greedy tokens,
alone and batched. The 8da4w bundle of a Q4_1 GGUF keeps the file's 4-bit blocks exactly (read
from the model loaded with them: tests/export/test_blocks.py), so its logits track the eager
model's up to the kernels' per-token int8 activations. (Both bundles are session fixtures,
``tiny_bundle`` and ``q41``, in tests/conftest.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.artifact.bundle import PROGRAM, TOKENIZER, WEIGHTS, read_bundle
from slotserve.artifact.weight_cache import file_digest
from slotserve.engine.probe import teacher_forced_logits
from slotserve.executor import Executor, TorchExecutor, executor_for
from slotserve.export import ExportOptions, export_bundle
from slotserve.export.bundle import HEAD_ROWS
from slotserve.kv import KVConfig, KVPool, StepBatch

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def on_the_runtime(bundle: Path) -> Executor:
    """The executor of the bundle's model: its program's methods, checked and loaded by
    `slotserve.load`, behind the one executor contract."""
    model = ss.load(bundle)
    assert model.weights is None and model.halves.kind == "program"
    executor = executor_for(model)
    assert isinstance(executor, TorchExecutor)
    assert executor.weight_bytes == read_bundle(bundle).resident_bytes
    assert executor.max_step_tokens == read_bundle(bundle).manifest.max_tokens
    return executor


def step(executor: Executor, pool: KVPool, batch: StepBatch, ids: list[int]) -> torch.Tensor:
    pool.begin_step(batch)
    return executor.step(torch.tensor(ids), batch, pool)


def prefill_then_decode(
    executor: Executor, model: ss.Model, ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The executor's logits for ``ids`` from an empty flat slot, then for one more token,
    beside the eager model's for the same two steps."""
    pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=64))
    pool.reserve(0, 64)
    prefill = step(executor, pool, StepBatch.single(0, len(ids)), ids)[0]
    decode = step(executor, pool, StepBatch.single(len(ids), 1), [ids[0]])[0]
    return torch.stack([prefill, decode]), torch.stack(
        [teacher_forced_logits(model, ids)[-1], teacher_forced_logits(model, [*ids, ids[0]])[-1]]
    )


def test_the_manifest_describes_the_bundle(tiny: ss.Model, tiny_bundle: Path) -> None:
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    assert manifest["schema"] == 1 and manifest["readable_by"] == [1]
    assert manifest["backend"] == "xnnpack" and manifest["delegates"] == ["XnnpackBackend"]
    assert manifest["quant"] == "fp32" and manifest["max_tokens"] == 512
    assert manifest["info"]["n_layers"] == tiny.info.n_layers
    assert manifest["files"] == {
        name: file_digest(tiny_bundle / name) for name in (PROGRAM, WEIGHTS, TOKENIZER)
    }
    methods = {m["name"]: m for m in manifest["methods"]}
    assert set(methods) == {"embed", "head", "weights_id"} | {
        f"layer{i}_{half}" for i in range(tiny.info.n_layers) for half in ("qkv", "out")
    }
    width = (tiny.info.n_heads + 2 * tiny.info.n_kv_heads) * tiny.info.head_dim
    assert methods["layer0_qkv"]["inputs"] == [["T", tiny.info.dim], ["T", width], ["T", width]]
    assert methods["layer0_qkv"]["outputs"] == [["T", width]]
    assert "off-graph" in manifest["kv_contract"]
    bundle = read_bundle(tiny_bundle)
    assert bundle.tokenizer.encode("hello") == tiny.tokenizer.encode("hello")
    assert bundle.tokenizer.chat_template == tiny.tokenizer.chat_template


def test_weights_live_in_the_weights_file(tiny: ss.Model, tiny_bundle: Path) -> None:
    """The program holds code; every weight is in weights.ptd, once (the shared copy)."""
    program, weights = (
        (tiny_bundle / PROGRAM).stat().st_size,
        (tiny_bundle / WEIGHTS).stat().st_size,
    )
    assert program < weights / 5
    # fp32: the weights file is the model's weights (the rows of each norm, once per method).
    assert tiny.weight_bytes <= weights < 1.1 * tiny.weight_bytes


def test_constant_methods_answer_the_runners_questions(tiny: ss.Model, tiny_bundle: Path) -> None:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(tiny_bundle / PROGRAM, data_path=tiny_bundle / WEIGHTS)
    answers = {
        name: program.load_method(name).execute([])
        for name in (
            "get_max_seq_len",
            "get_max_context_len",
            "get_bos_id",
            "get_eos_ids",
            "use_kv_cache",
            "enable_dynamic_shape",
            "get_vocab_size",
            "get_n_layers",
            "get_bundle_schema",
        )
    }
    assert answers == {
        "get_max_seq_len": [512],
        "get_max_context_len": [tiny.info.max_context],
        "get_bos_id": [tiny.info.bos_id],
        "get_eos_ids": list(tiny.info.eos_ids),
        "use_kv_cache": [True],
        "enable_dynamic_shape": [True],
        "get_vocab_size": [tiny.info.vocab_size],
        "get_n_layers": [tiny.info.n_layers],
        "get_bundle_schema": [1],
    }


def test_fp32_logits_equal_the_eager_models(tiny: ss.Model, tiny_bundle: Path) -> None:
    executor = on_the_runtime(tiny_bundle)
    gen = torch.Generator().manual_seed(0)
    for length in (1, 7, 40):
        ids = torch.randint(3, 250, (length,), generator=gen).tolist()
        ours, expected = prefill_then_decode(executor, tiny, ids)
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_fp32_bundle_generates_the_torch_executors_tokens_alone_and_batched(
    tiny: ss.Model, tiny_bundle: Path
) -> None:
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    config = ss.EngineConfig(max_seqs=3, max_context=64)
    results: dict[str, list[tuple[int, ...]]] = {}
    for name, model in (("torch", tiny), ("executorch", ss.load(tiny_bundle))):
        with ss.Engine(model, config) as engine:
            batched = [engine.submit(p, GREEDY) for p in prompts]
            results[name] = [tuple(h.result().tokens) for h in batched]
            alone = [tuple(engine.submit(p, GREEDY).result().tokens) for p in prompts]
            assert alone == results[name]
            engine.check_integrity()
    assert results["executorch"] == results["torch"]


@pytest.mark.parametrize("layout", ["flat", "ring", "cell"])
def test_a_bundle_serves_on_every_layout(tiny_bundle: Path, layout: str) -> None:
    model = ss.load(tiny_bundle)
    assert model.weights is None and model.weight_bytes == read_bundle(tiny_bundle).resident_bytes
    config = ss.EngineConfig(max_seqs=2, max_context=64, kv_layout=layout, ring_window=16)
    with ss.Engine(model, config) as engine:
        assert engine.plan.to_dict()["arenas"]["weights"] == model.weight_bytes
        handles = [engine.submit([5, 6, 7, 8], GREEDY), engine.submit([9, 10], GREEDY)]
        finals = [h.result() for h in handles]
        engine.check_integrity()
    assert [len(f.tokens) for f in finals] == [12, 12]


def test_steps_stay_within_the_program(tiny_bundle: Path, q41: tuple[ss.Model, Path]) -> None:
    model, path = q41
    executor = on_the_runtime(path)
    assert executor.max_step_tokens == 64
    pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=128))
    pool.reserve(0, 128)
    with pytest.raises(ValueError, match="exceeds the 64 the program"):
        step(executor, pool, StepBatch.single(0, 65), [5] * 65)
    # The engine takes the program's step size (a larger step only splits prefill less)...
    with ss.Engine(ss.load(path), ss.EngineConfig(max_seqs=2, max_context=128)) as engine:
        assert engine.config.max_batch_tokens == 64 and engine.config.prefill_chunk == 64
        long_prompt = engine.submit(list(range(5, 105)), GREEDY).result()  # 100 > 64 tokens
        assert len(long_prompt.tokens) == 12
    # ...but every running sequence must fit in one decode step.
    with pytest.raises(ValueError, match="max_seqs=65 exceeds the 64 tokens"):
        ss.Engine(ss.load(path), ss.EngineConfig(max_seqs=65, max_context=64))


def test_8da4w_logits_track_the_eager_model(q41: tuple[ss.Model, Path]) -> None:
    model, path = q41
    executor = on_the_runtime(path)
    gen = torch.Generator().manual_seed(0)
    agree = total = 0
    for length in (1, 7, 40):
        ids = torch.randint(3, 250, (length,), generator=gen).tolist()
        for ours, expected in zip(*prefill_then_decode(executor, model, ids), strict=True):
            # int8 per-token activations (and int8 embedding and head rows): a small
            # relative error, the same ranking mostly.
            error = (ours - expected).abs().max() / expected.abs().max()
            assert error < 0.1, float(error)
            agree += int(ours.argmax() == expected.argmax())
            total += 1
    assert agree >= total - 1, f"{agree}/{total}"


def test_8da4w_rows_of_a_step_are_independent(q41: tuple[ss.Model, Path]) -> None:
    """Activations are quantised per token (both passes of `TwoPass`), so every method gives
    a row the same bits whatever other rows share its step."""
    from executorch.runtime import Runtime

    model, path = q41
    info = model.info
    program = Runtime.get().load_program(path / PROGRAM, data_path=path / WEIGHTS)
    gen = torch.Generator().manual_seed(0)
    rows, width = 9, (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    x = torch.randn(rows, info.dim, generator=gen)
    attn = torch.randn(rows, info.n_heads * info.head_dim, generator=gen)
    cos, sin = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    for name, inputs in {
        "layer0_qkv": [x, cos, sin],
        "layer1_out": [x, attn],
        "head": [x],
    }.items():
        method = program.load_method(name)
        whole = method.execute(inputs)[0].clone()
        for begin, end in ((0, 3), (3, 5), (5, 9)):
            part = method.execute([t[begin:end].contiguous() for t in inputs])[0]
            assert torch.equal(part, whole[begin:end]), (name, begin, end)


def test_8da4w_batch_equals_each_sequence_alone(q41: tuple[ss.Model, Path]) -> None:
    """Per-token activation quantisation keeps the rows of a step independent (fp32 KV:
    the pool's torch attention moves last bits with the batch, and fp16 storage turns a
    few into rounding steps that the attention output's int8 quantisation amplifies to
    0.05 in a logit)."""
    model, path = q41
    executor = on_the_runtime(path)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    config = KVConfig(layout="cell", max_seqs=3, max_context=32, dtype="fp32")
    pool = KVPool(model.info, config)
    for session in range(3):
        pool.reserve(session, 32)
    batch = StepBatch([0, 1, 2], [0, 0, 0], [len(p) for p in prompts])
    together = step(executor, pool, batch, [t for p in prompts for t in p])
    for b, prompt in enumerate(prompts):
        alone_pool = KVPool(model.info, config)
        alone_pool.reserve(0, 32)
        alone = step(executor, alone_pool, StepBatch.single(0, len(prompt)), prompt)
        torch.testing.assert_close(together[b], alone[0], rtol=0, atol=1e-5)


def test_the_head_takes_a_step_of_more_sequences_than_its_rows(
    tiny: ss.Model, tiny_bundle: Path
) -> None:
    """The head is lowered for `HEAD_ROWS` rows (its logits are planned memory); a step of
    more sequences runs it in several calls, with the same logits."""
    executor = on_the_runtime(tiny_bundle)
    sequences = HEAD_ROWS + 5
    # fp32 KV: the program's and the eager model's q/k/v rows differ in last bits, which
    # fp16 storage can round apart (7.6e-4 in a logit); the head's calls are what is tested
    config = KVConfig(layout="cell", max_seqs=sequences, max_context=16, dtype="fp32")
    pool, eager_pool = KVPool(tiny.info, config), KVPool(tiny.info, config)
    for session in range(sequences):
        pool.reserve(session, 16)
        eager_pool.reserve(session, 16)
    batch = StepBatch(list(range(sequences)), [0] * sequences, [2] * sequences)
    ids = [3 + (i % 200) for i in range(2 * sequences)]
    logits = step(executor, pool, batch, ids)
    eager_pool.begin_step(batch)
    expected = tiny.forward(torch.tensor(ids), batch, eager_pool)
    assert logits.shape == (sequences, tiny.info.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_8da4w_keeps_the_weights_near_the_files_size(q41: tuple[ss.Model, Path]) -> None:
    model, path = q41
    gguf_bytes = Path(model.source).stat().st_size
    bundle = read_bundle(path)
    assert bundle.resident_bytes < 0.5 * model.weight_bytes  # the eager fp32 copy
    # The target (1.3x the GGUF) holds for the weights; the program is code, a few
    # KiB a method whatever the model's size (it dominates only a tiny model's bundle).
    assert (path / WEIGHTS).stat().st_size < 1.3 * gguf_bytes
    methods = len(json.loads((path / "manifest.json").read_text())["methods"])
    assert (path / PROGRAM).stat().st_size < methods * 32 * 1024


def test_export_refuses_what_it_cannot_express(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    qwen2 = ss.load(tiny_dirs["qwen2"])
    with pytest.raises(ValueError, match="qkv_bias"):
        export_bundle(qwen2, tmp_path / "x", ExportOptions())
    with pytest.raises(ValueError, match="8da4w runs on XNNPACK"):
        ExportOptions(backend="portable", quant="8da4w")
    int8 = ss.load(tiny_dirs["llama"], weights="int8")
    with pytest.raises(ValueError, match="drop --weights"):
        export_bundle(int8, tmp_path / "x", ExportOptions())
    assert not (tmp_path / "x").exists()


def test_export_never_replaces_a_directory_that_is_not_a_bundle(
    tiny: ss.Model, tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a bundle"):
        export_bundle(tiny, tmp_path, ExportOptions(quant="fp32"))
    assert (tmp_path / "notes.txt").read_text() == "mine"
