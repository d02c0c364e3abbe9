"""The encoder engine's limits (`EncoderConfig`) and its memory plan (`plan_encoder`).

An encoder holds no KV pool: past its weights and tokenizer (marked by its load), it needs
the transient memory of its largest step (``max_batch_texts`` texts of ``max_seq_len``
tokens), the forward it may hold between two layers while other work takes the device (one
at most: the packed rows of at most a largest step's texts) and the results of the texts it
has admitted (``max_texts`` rows of token ids and embeddings). `plan_encoder` is the one
place that runs an encoder step outside serving: it measures the largest step's anonymous
peak growth (at least `EncoderModel.step_bytes`) and adds it to the ledger's ``activations``
arena, adds the held forward and the results, computed, to the same arena, then checks the
whole ledger against the budget, so a multi-model server that gives every model the one
device ledger checks them together. Nothing is allocated at run time beyond these: a step is
never larger, the engine holds one split forward at most (its ``check_integrity`` holds it
within `EncoderPlan.held_bytes`), and admission never holds more than ``max_texts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotserve.errors import PlanError
from slotserve.memory import (
    Budget,
    MemoryLedger,
    budget_problems,
    format_bytes,
    parse_bytes,
    read_process,
    reset_peak,
    trim_heap,
)
from slotserve.model.encoder import EncoderModel

ENCODER_POLICIES = ("isolate", "fifo")
PROBE_SOURCE = "the encoder's largest step"
RESULTS_SOURCE = "the encoder's admitted texts"
HELD_SOURCE = "the encoder's forward held between layers"


@dataclass(frozen=True)
class EncoderConfig:
    """Limits and policies of an `EncoderEngine`.

    ``max_texts`` texts may be admitted at once (each request holds all of its texts from
    admission to its end; one of more texts is refused ``batch_too_large``); a step embeds
    at most ``max_batch_texts`` of them. ``queue_depth`` requests may wait for room (0:
    refuse at once with ``slots_full``), each at most ``queue_timeout_s``. ``policy``:
    ``"isolate"`` never batches two priority classes together (interactive first,
    background at least ``background_min_share`` of contended steps), ``"fifo"`` batches
    every class. ``memory_budget`` (bytes, ``"1GiB"``, or None) is checked against the
    whole ledger the engine plans in: the process's when it is the load's."""

    max_texts: int = 256
    max_batch_texts: int = 32
    queue_depth: int = 0
    queue_timeout_s: float = 30.0
    policy: str = "isolate"
    background_min_share: float = 0.1
    memory_budget: int | str | None = None

    def __post_init__(self) -> None:
        if self.max_batch_texts < 1:
            raise ValueError(f"max_batch_texts={self.max_batch_texts} must be >= 1")
        if self.max_texts < self.max_batch_texts:
            raise ValueError(
                f"max_texts={self.max_texts} must be >= max_batch_texts={self.max_batch_texts}"
            )
        if self.queue_depth < 0:
            raise ValueError(f"queue_depth={self.queue_depth} must be >= 0")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s={self.queue_timeout_s} must be > 0")
        if self.policy not in ENCODER_POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {ENCODER_POLICIES}")
        if not 0.0 <= self.background_min_share < 1.0:
            raise ValueError(f"background_min_share={self.background_min_share} must be in [0, 1)")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # ValueError naming the value

    @property
    def budget(self) -> Budget | None:
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)


@dataclass(frozen=True)
class EncoderPlan:
    """What `plan_encoder` added to the ledger: the largest step's shape and measured
    bytes, the computed bytes of a forward held between layers (`held_bytes`: a largest
    step's packed rows) and of the admitted texts, and the budget they were checked
    against."""

    step_texts: int
    step_tokens_per_text: int
    step_bytes: int
    held_bytes: int
    results_bytes: int
    budget: Budget | None

    @property
    def total(self) -> int:
        return self.step_bytes + self.held_bytes + self.results_bytes

    def to_dict(self) -> dict[str, object]:
        return {
            "step_texts": self.step_texts,
            "step_tokens_per_text": self.step_tokens_per_text,
            "step_bytes": self.step_bytes,
            "held_bytes": self.held_bytes,
            "results_bytes": self.results_bytes,
            "budget": None if self.budget is None else str(self.budget),
        }


def results_bytes(model: EncoderModel, config: EncoderConfig) -> int:
    """The admitted texts' worst case: ``max_texts`` rows of ``max_seq_len`` token ids
    (Python ints, 8 bytes each counted) and one fp32 embedding each."""
    info = model.info
    return config.max_texts * (info.max_seq_len * 8 + info.dim * 4)


def measure_largest_step(model: EncoderModel, n_texts: int) -> int:
    """Run ``n_texts`` texts of ``max_seq_len`` tokens once; the anonymous peak growth it
    caused (a bound: the resident peak less what was resident before), at least
    `EncoderModel.step_bytes`."""
    longest = model.info.max_seq_len
    texts = [[0] * longest for _ in range(n_texts)]
    model.embed(texts[:1])  # one-time state (thread pools, kernels' tables) is not the step's
    trim_heap()
    reset_peak()
    before = read_process()
    model.embed(texts)
    grown = read_process().peak - before.file - before.shared - before.anonymous
    trim_heap()
    return max(grown, model.step_bytes(n_texts, longest))


def plan_encoder(
    model: EncoderModel, config: EncoderConfig, ledger: MemoryLedger | None = None
) -> tuple[EncoderPlan, MemoryLedger]:
    """Measure and add the engine's arenas to ``ledger`` (default: the model's load's, else
    a new one holding the weights, computed), then check it against the budget: a
    `PlanError` naming the arenas, the budget and the levers when it does not fit."""
    if ledger is None:
        ledger = model.ledger if model.ledger is not None else MemoryLedger()
    if not ledger.has("weights"):  # a model built without `load_encoder`: not measured
        ledger.add("weights", model.weight_bytes, "computed", "the encoder's weights")
    with torch.inference_mode():
        step = measure_largest_step(model, config.max_batch_texts)
    ledger.add("activations", step, "measured", PROBE_SOURCE)
    held = model.held_bytes(config.max_batch_texts, model.info.max_seq_len)
    ledger.add("activations", held, "computed", HELD_SOURCE)
    results = results_bytes(model, config)
    ledger.add("activations", results, "computed", RESULTS_SOURCE)
    longest = model.info.max_seq_len
    plan = EncoderPlan(config.max_batch_texts, longest, step, held, results, config.budget)
    problems = budget_problems(ledger.arenas(), ledger.peak_bytes, config.budget)
    if problems:
        raise PlanError(
            f"the encoder does not fit: {'; '.join(problems)} (its largest step of "
            f"max_batch_texts={config.max_batch_texts} texts x {model.info.max_seq_len} "
            f"tokens needs {format_bytes(step)} and {format_bytes(held)} held between "
            f"layers, max_texts={config.max_texts} admitted texts {format_bytes(results)}); "
            "lower max_batch_texts or max_texts, load the weights as q8_0, or raise memory_budget"
        )
    return plan, ledger
