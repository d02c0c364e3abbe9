"""The executor contract (`slotserve.executor.base.Executor`): the executor satisfies it
whatever the model's halves (a bundle's program included), its two facts
(``weight_bytes``, ``max_step_tokens``) are the halves', and the engine keeps every step
within ``max_step_tokens``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import slotserve as ss
import slotserve.executor
from slotserve.artifact.program import ProgramHalves
from slotserve.engine.probe import teacher_forced_logits
from slotserve.executor import Executor, TorchExecutor, executor_for
from slotserve.executor.base import Executor as BaseExecutor
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model.halves import HalvesKind, LayerHalves, StepContext
from slotserve.model.weights import LlamaWeights

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
FACTS = ("weight_bytes", "max_step_tokens")


def test_the_package_exports_the_contract() -> None:
    assert Executor is BaseExecutor
    assert {"Executor", "TorchExecutor", "executor_for"} <= set(slotserve.executor.__all__)


def has_the_facts(cls: type[Any]) -> bool:
    return all(isinstance(getattr(cls, name, None), property) for name in FACTS)


def test_the_executor_satisfies_the_protocol_structurally() -> None:
    """Its two facts are properties and ``step`` takes the protocol's parameters (mypy checks
    the types: `executor_for` returns it as an `Executor`). A bundle runs on the same
    executor, through `ProgramHalves`, which has the facts it forwards."""
    assert has_the_facts(TorchExecutor) and has_the_facts(ProgramHalves)
    expected = list(inspect.signature(BaseExecutor.step).parameters)
    assert list(inspect.signature(TorchExecutor.step).parameters) == expected


def test_the_executor_is_the_models_forward(tiny: ss.Model) -> None:
    executor = executor_for(tiny)
    assert isinstance(executor, TorchExecutor)
    assert executor.weight_bytes == tiny.weight_bytes > 0
    assert executor.max_step_tokens is None  # eager halves take any step
    ids = [5, 6, 7, 8]
    pool = KVPool(tiny.info, KVConfig(layout="flat", max_seqs=1, max_context=16))
    pool.reserve(0, 16)
    batch = StepBatch.single(0, len(ids))
    pool.begin_step(batch)
    logits = executor.step(torch.tensor(ids), batch, pool)
    assert logits.shape == (1, tiny.info.vocab_size)
    torch.testing.assert_close(
        logits[0], teacher_forced_logits(tiny, ids)[-1], rtol=1e-5, atol=1e-5
    )


class LimitedHalves:
    """A model's halves with a step limit and another resident size, as a bundle's program
    has them; records the tokens of each step."""

    def __init__(self, inner: LayerHalves[Any], limit: int, weight_bytes: int) -> None:
        self.inner, self.limit, self._weight_bytes = inner, limit, weight_bytes
        self.steps: list[int] = []

    @property
    def kind(self) -> HalvesKind:
        return self.inner.kind

    @property
    def weights(self) -> LlamaWeights | None:
        return self.inner.weights

    @property
    def planned_method_bytes(self) -> int:
        return self.inner.planned_method_bytes

    @property
    def mapped_weight_bytes(self) -> int:
        return self.inner.mapped_weight_bytes

    @property
    def weight_bytes(self) -> int:
        return self._weight_bytes

    @property
    def max_step_tokens(self) -> int | None:
        return self.limit

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        self.steps.append(tokens.numel())
        return self.inner.embed(tokens)

    def begin_step(self, context: StepContext) -> Any:
        return self.inner.begin_step(context)

    def end_step(self, step: Any) -> None:
        self.inner.end_step(step)

    def qkv(self, layer: int, x: torch.Tensor, step: Any) -> torch.Tensor:
        return self.inner.qkv(layer, x, step)

    def out(self, layer: int, x: torch.Tensor, attn: torch.Tensor, step: Any) -> torch.Tensor:
        return self.inner.out(layer, x, attn, step)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.head(x)


def limited(model: ss.Model, limit: int) -> tuple[ss.Model, LimitedHalves]:
    halves = LimitedHalves(model.halves, limit, weight_bytes=12345)
    return ss.Model(model.info, model.tokenizer, halves, model.source, model.kernels), halves


def test_the_facts_are_the_halves(tiny: ss.Model) -> None:
    model, _ = limited(tiny, 8)
    executor = executor_for(model)
    assert executor.max_step_tokens == 8 and executor.weight_bytes == 12345


def greedy_tokens(model: ss.Model, config: ss.EngineConfig) -> list[list[int]]:
    prompts = [list(range(5, 25)), [9, 10, 11]]  # 20 tokens: more than one step of 8
    with ss.Engine(model, config) as engine:
        handles = [engine.submit(p, GREEDY) for p in prompts]
        tokens = [list(h.result().tokens) for h in handles]
        engine.check_integrity()
    return tokens


def test_the_engine_keeps_steps_within_max_step_tokens(tiny: ss.Model) -> None:
    """A larger ``max_batch_tokens`` (and prefill chunk) is lowered to the limit and the plan
    counts the executor's weights; prefill only splits into more chunks, so the tokens are
    the unlimited model's."""
    model, halves = limited(tiny, 8)
    config = ss.EngineConfig(max_seqs=2, max_context=64, max_batch_tokens=32, prefill_chunk=16)
    with ss.Engine(model, config) as engine:
        assert engine.config.max_batch_tokens == 8 and engine.config.prefill_chunk == 8
        assert engine.plan.to_dict()["arenas"]["weights"] == 12345
    tokens = greedy_tokens(model, config)
    assert halves.steps and max(halves.steps) <= 8
    assert tokens == greedy_tokens(tiny, config)


def test_a_limit_above_the_config_changes_nothing(tiny: ss.Model) -> None:
    config = ss.EngineConfig(max_seqs=2, max_context=64, max_batch_tokens=32, prefill_chunk=16)
    with ss.Engine(limited(tiny, 64)[0], config) as engine:
        assert engine.config == config


def test_the_engine_refuses_more_sequences_than_one_step_holds(tiny: ss.Model) -> None:
    """Every running sequence decodes in one step, so ``max_seqs`` above the limit cannot
    be served: refused at start, naming both numbers."""
    config = ss.EngineConfig(max_seqs=9, max_context=64, max_batch_tokens=32)
    with pytest.raises(ValueError, match="max_seqs=9 exceeds the 8 tokens"):
        ss.Engine(limited(tiny, 8)[0], config)
