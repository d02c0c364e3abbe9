"""`EngineConfig`: one engine's limits and policies, validated up front."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from slotserve.info import ModelInfo
from slotserve.kv.config import DEFAULT_KV_DTYPE, KVConfig
from slotserve.memory import MemoryLedger, MemoryMap, parse_bytes
from slotserve.native import KERNEL_CHOICES, KernelChoice
from slotserve.plan import CapacityPlan

log = logging.getLogger("slotserve")
POLICIES = ("isolate", "fifo")
BudgetScope = Literal["model", "process"]
BUDGET_SCOPES: tuple[BudgetScope, ...] = ("model", "process")

# Background's minimum share of steps under ``isolate`` when it competes with other classes.
# At 0.1 a background job advances one step in ten while a chat turn streams, instead of
# waiting for the whole turn; `slotserve bench mixed` measures what it costs the chat turn's
# inter-token latency.
DEFAULT_BACKGROUND_SHARE = 0.1
# The disk the prefix store may take when prefix_store is set and its bytes are not.
DEFAULT_PREFIX_STORE_BYTES = "4GiB"
# A device's flash is a budget too: the store writes at most this many bytes a second on
# average (a burst of `slotserve.prefix.store.WRITE_BURST_S` seconds' worth at once), and
# only snapshots of at least this many tokens (shorter ones are cheaper to compute again).
DEFAULT_PREFIX_STORE_WRITE_RATE = "4MiB"
DEFAULT_PREFIX_STORE_MIN_TOKENS = 64
StoreWrites = Literal["reused", "all"]
STORE_WRITES: tuple[StoreWrites, ...] = ("reused", "all")
SpeculateMode = Literal["ngram", "draft", "off"]
SPECULATE_MODES: tuple[SpeculateMode, ...] = ("ngram", "draft", "off")
# How a draft model's weights may be held (`slotserve.load`'s ``weights``).
DRAFT_WEIGHTS = ("auto", "gguf", "fp32", "int8")
# The longest draft one request verifies in a step (speculate_max_draft's default).
DEFAULT_MAX_DRAFT = 8


@dataclass(frozen=True)
class EngineConfig:
    """Limits and policies of an `Engine`.

    ``max_seqs`` is the hard ceiling on live sessions. With the cell layout, ``num_blocks``
    sizes the shared block pool below ``max_seqs × max_context`` (admission then refuses
    with ``kv_exhausted`` when a request's worst case does not fit the free blocks).
    ``queue_depth`` requests may wait for a slot (0: refuse at once), each at most
    ``queue_timeout_s``. ``policy="isolate"`` never
    co-batches priority classes (interactive first; background gets at least
    ``background_min_share`` of steps when it competes with other classes, so it is never
    starved); ``"fifo"`` co-batches everything.
    Prompts are prefilled ``prefill_chunk`` tokens at a time, interleaved with decodes, and a
    step computes at most ``max_batch_tokens`` tokens. A cancel is released at the next
    batch boundary, so the largest step bounds it: a cancellation-critical workload caps
    ``max_batch_tokens`` (the ``voice`` preset does; `Engine.cancel_bound` states the bound).
    ``prefix_cache_bytes`` (bytes or ``"256MiB"``; 0: off) is the budget of KV blocks the
    prefix cache may pin for snapshots of completed prompts; it needs ``kv_layout="cell"``
    (blocks shared) or ``"ring"`` (rings copied; the retention rule refuses a prefix a
    wrapped ring no longer holds).
    ``prefix_store`` (a directory; None: off) gives the prefix cache a disk tier of at most
    ``prefix_store_bytes``: snapshots are written there in the background and restored
    after a restart (`slotserve.prefix.store`); it needs the prefix cache on. With
    ``prefix_store_writes="reused"`` only snapshots likely to be used again are written (a
    conversation's latest turn, a prompt that was hit); ``"all"`` writes every prompt's
    too, as soon as it is published. Either way only those of at least
    ``prefix_store_min_tokens`` tokens, at most ``prefix_store_write_rate`` bytes a second
    on average.
    ``kernels="auto"`` attends decode-sized steps with the compiled kernel the model was
    loaded with (`slotserve.native`); ``"off"`` keeps torch SDPA for every step (the
    model's own kernels are chosen at load: ``slotserve.load(..., kernels="off")``).
    ``budget_scope`` says what ``memory_budget`` holds: ``"process"`` (what the commands
    use) the whole process, its runtime arena (the resident set before the weights) and its
    weights as resident, both measured when `slotserve.load` loaded the model, so a budget
    under the runtime alone is refused with that number; ``"model"`` (the default here) the
    model's arenas only, the weights at their own bytes, for a program that embeds the engine
    and budgets the rest of its process itself.
    ``speculate="ngram"`` drafts tokens for decoding requests from their own prompt and
    output and verifies them in one step (`slotserve.engine.speculate`), at most
    ``speculate_max_draft`` a request a step; the output is the same as with ``"off"``, bit
    for bit: only the number of steps changes. ``speculate="draft"`` drafts with a second
    model instead, ``draft_model`` (a spec `slotserve.load` reads, its weights held as
    ``draft_weights``; or the model passed as `Engine`'s ``draft``), run greedily on a flat
    KV pool of its own (`slotserve.engine.draft`); its weights, KV and activations are
    arenas of the memory plan.
    A workload preset (`slotserve.engine.presets.preset_config`) is a set of overrides of
    these fields, sized to a budget; the defaults here are the only ones.
    """

    max_seqs: int = 4
    max_context: int = 2048
    kv_layout: str = "flat"
    kv_dtype: str = DEFAULT_KV_DTYPE
    block_size: int = 16
    ring_window: int = 1024
    sinks: int = 0
    num_blocks: int | None = None
    memory_budget: int | str | None = None
    memory_map: MemoryMap | None = None
    policy: str = "isolate"
    prefill_chunk: int = 256
    max_batch_tokens: int = 512
    queue_depth: int = 0
    queue_timeout_s: float = 30.0
    background_min_share: float = DEFAULT_BACKGROUND_SHARE
    prefix_cache_bytes: int | str = 0
    prefix_store: str | Path | None = None
    prefix_store_bytes: int | str = DEFAULT_PREFIX_STORE_BYTES
    prefix_store_write_rate: int | str = DEFAULT_PREFIX_STORE_WRITE_RATE
    prefix_store_min_tokens: int = DEFAULT_PREFIX_STORE_MIN_TOKENS
    prefix_store_writes: StoreWrites = "reused"
    kernels: KernelChoice = "auto"
    budget_scope: BudgetScope = "model"
    speculate: SpeculateMode = "off"
    speculate_max_draft: int = DEFAULT_MAX_DRAFT
    draft_model: str | Path | None = None
    draft_weights: str = "auto"

    def __post_init__(self) -> None:
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope={self.budget_scope!r} is not one of {BUDGET_SCOPES}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r} is not one of {KERNEL_CHOICES}")
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(f"speculate={self.speculate!r} is not one of {SPECULATE_MODES}")
        if self.speculate_max_draft < 1:
            raise ValueError(
                f"speculate_max_draft={self.speculate_max_draft} must be >= 1 (to turn "
                "speculation off: speculate='off')"
            )
        if self.draft_model is not None and self.speculate != "draft":
            raise ValueError(
                f"draft_model={str(self.draft_model)!r} drafts only with speculate='draft', "
                f"not {self.speculate!r}"
            )
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights={self.draft_weights!r} is not one of {DRAFT_WEIGHTS}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {POLICIES}")
        if self.prefill_chunk < 1 or self.max_batch_tokens < 1:
            raise ValueError(
                f"prefill_chunk={self.prefill_chunk} and max_batch_tokens="
                f"{self.max_batch_tokens} must be >= 1"
            )
        if self.max_batch_tokens < self.max_seqs:
            raise ValueError(
                f"max_batch_tokens={self.max_batch_tokens} must be >= max_seqs={self.max_seqs} "
                "(one decode token per live session)"
            )
        if self.queue_depth < 0 or self.queue_timeout_s <= 0:
            raise ValueError("queue_depth must be >= 0 and queue_timeout_s > 0")
        if not 0.0 <= self.background_min_share < 1.0:
            raise ValueError(f"background_min_share={self.background_min_share} not in [0, 1)")
        if isinstance(self.memory_budget, str):
            parse_bytes(self.memory_budget)  # fail here, with the parser's message
        self.kv_config()  # validates layout, dtype, sizes
        if self.prefix_store is not None:
            if not str(self.prefix_store):
                raise ValueError("prefix_store='' is not a directory; pass one, or None (off)")
            if self.prefix_store_budget <= 0:
                raise ValueError(f"prefix_store_bytes={self.prefix_store_bytes!r} must be > 0")
            if parse_bytes(self.prefix_store_write_rate) <= 0:
                raise ValueError(
                    f"prefix_store_write_rate={self.prefix_store_write_rate!r} must be > 0 "
                    "bytes a second (serve: --prefix-store-write-rate, e.g. 4MiB)"
                )
            if self.prefix_store_writes not in STORE_WRITES:
                raise ValueError(
                    f"prefix_store_writes={self.prefix_store_writes!r} is not one of {STORE_WRITES}"
                )
            if self.prefix_store_min_tokens < 1:
                raise ValueError(
                    f"prefix_store_min_tokens={self.prefix_store_min_tokens} must be >= 1"
                )
            if not self.prefix_cache_budget:
                raise ValueError(
                    f"prefix_store={str(self.prefix_store)!r} is the prefix cache's disk tier "
                    "and needs the cache on: set prefix_cache_bytes (serve: --prefix-cache "
                    "BYTES), or leave prefix_store off"
                )
        self.prefix_cache_budget  # noqa: B018 (validates: the parser's message)

    @property
    def prefix_store_budget(self) -> int:
        """``prefix_store_bytes`` in bytes."""
        return parse_bytes(self.prefix_store_bytes)

    @property
    def prefix_cache_budget(self) -> int:
        """``prefix_cache_bytes`` in bytes (0: the prefix cache is off)."""
        return parse_bytes(self.prefix_cache_bytes)

    def kv_config(self) -> KVConfig:
        return KVConfig(
            layout=self.kv_layout,
            max_seqs=self.max_seqs,
            max_context=self.max_context,
            block_size=self.block_size,
            dtype=self.kv_dtype,
            ring_window=self.ring_window,
            sinks=self.sinks,
            num_blocks=self.num_blocks,
        )

    def kv_bytes(self, info: ModelInfo) -> int:
        """The bytes of this config's KV pool for a model of ``info`` (its plan's ``kv``
        arena, without the prefix cache's copies)."""
        return CapacityPlan(info, self.kv_config()).kv_bytes

    def plan(
        self, info: ModelInfo, ledger: MemoryLedger, *, attention_kernel: bool = False
    ) -> CapacityPlan:
        """The plan of this config for a model of ``info``: ``ledger``'s arenas (the
        runtime, the tokenizer, the weights, ...: `slotserve.engine.probe.ledger_for`) and
        this config's KV pool and activations, against its budget; ``attention_kernel``:
        the pool attends with the compiled kernel (`CapacityPlan.attention_kernel`)."""
        budget = None if self.memory_budget is None else parse_bytes(self.memory_budget)
        return CapacityPlan(
            info,
            self.kv_config(),
            ledger,
            self.max_batch_tokens,
            budget,
            self.memory_map,
            self.prefix_cache_budget,
            attention_kernel,
        )

    def within_step_limit(self, limit: int | None) -> EngineConfig:
        """This config with steps no larger than an executor takes (``limit``: a lowered
        program's size): a smaller step only splits prefill into smaller chunks. Every
        running sequence must still fit in one decode step, so ``max_seqs`` above the limit
        is refused."""
        if limit is None or self.max_batch_tokens <= limit:
            return self
        if self.max_seqs > limit:
            raise ValueError(
                f"max_seqs={self.max_seqs} exceeds the {limit} tokens a step of this "
                f"executor takes (its program was lowered for {limit}); use max_seqs <= "
                f"{limit} or export again with a larger --max-batch-tokens"
            )
        log.info(
            "max_batch_tokens %d -> %d: the executor's largest step", self.max_batch_tokens, limit
        )
        return replace(self, max_batch_tokens=limit, prefill_chunk=min(self.prefill_chunk, limit))
