"""`CapacityPlan`: will the whole process fit the budget: the arenas of its memory ledger
(the runtime, the tokenizer, the weights, a bundle's methods, the grammar compiler's index
and its grammars, measured or computed where each is held: `slotserve.memory.ledger`) and
the engine's own KV pool and activations, computed here from `ModelInfo` and `KVConfig`
alone (no allocation), with the same placement rules the pool allocates by, so the planned
KV bytes equal the pool's measured bytes. The budget must hold the larger of that sum and
the ledger's transient peaks (a load's copies: `required_bytes`). If the plan does not fit,
`check()` raises `PlanError` naming the largest ``max_seqs`` and the largest
``max_context`` that would, or, when the ledger's arenas alone or a peak are over the
budget, that number (`LoadPeakError`); a memory map that leaves out an arena is refused
naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slotserve.errors import PlanError
from slotserve.info import ModelInfo
from slotserve.kv.config import KVConfig
from slotserve.kv.placement import cells_per_layer, cells_per_session, layer_rules
from slotserve.memory import MemoryLedger, MemoryMap, budget_problems, format_bytes

# The arenas a plan computes itself from its config; the ledger holds the rest.
COMPUTED_ARENAS = ("kv", "activations")


class LoadPeakError(PlanError):
    """The model's load peaks above the budget (``peak_bytes`` over ``budget_bytes``): the
    process would be killed while loading, whatever the serving plan."""

    def __init__(self, message: str, peak_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.peak_bytes, self.budget_bytes = peak_bytes, budget_bytes


def kv_cell_bytes(info: ModelInfo, kv: KVConfig) -> int:
    """Bytes of one position of K (or V) in one layer, scales included."""
    element = kv.torch_dtype.itemsize
    scales = info.n_kv_heads * 4 if kv.dtype == "int8" else 0
    return info.n_kv_heads * info.head_dim * element + scales


# What a step's resident growth adds to its live bytes once the C heap was trimmed (a server
# trims when it idles: `slotserve.memory.IdleTrim`): the trim released the free pages in the
# middle of the heap, and the step's allocations fault them back wherever they land, the
# small ones a page each. That follows the count of a step's allocations, not its sizes, so
# it is one figure for every config; with the eighth kept over the rest, the largest steps
# `slotserve plan --measure` and `slotserve bench memory` measured stay within the plan on
# the bundled model and Gemma 3 (docs/BENCHMARKS.md, "memory").
HEAP_REFAULT = 8 << 20
# The live bytes of one costliest draw, in floats a vocabulary entry: the most that
# `sample_batch` and `token_logprobs` hold allocated at once (the allocator's own count,
# apart from the pages a trim makes them fault: `HEAP_REFAULT`), with room over the
# vocabularies measured (docs/BENCHMARKS.md, "memory").
DRAW_FLOATS = 12


def activation_bytes(
    info: ModelInfo, kv: KVConfig, max_batch_tokens: int, attention_kernel: bool = False
) -> int:
    """Estimate of the transient memory of the largest step (fp32): per-token buffers of
    one layer, the logits of every session and their sampling (with each live request's
    sampler state), the pages a trimmed heap faults back (`HEAP_REFAULT`), and the RoPE
    tables of ``max_context`` positions (exact bytes,
    `ModelInfo.rope_table_bytes`; an engine builds them before it measures its largest
    step: `slotserve.engine.probe`); with torch's attention
    (``attention_kernel`` False: `kernels="off"`, or no compiled kernel) also a
    materialised attention score/mask block and one layer's gathered K/V for every
    session, where the compiled kernel (`slotserve.native.attention`) attends over the
    pool's cells in place with a softmax row a query head."""
    tokens, seqs, context = max_batch_tokens, kv.max_seqs, kv.max_context
    q_width = info.n_heads * info.head_dim
    per_token = 6 * info.dim + q_width + 2 * info.kv_dim + 3 * info.ffn_dim
    # The step's logits (each session's last) and their sampling: a private copy where a
    # request biases or constrains its row, and one row drawn at a time as the costliest
    # settings draw it (`COSTLIEST_SAMPLING`: its penalised copy, probabilities in float64
    # sorted with int64 indices for top-p, their running sum, the filtered copy and the
    # log-probabilities: `DRAW_FLOATS` an entry), beside every live request's sampler state
    # (a seen flag and a count a token: 5 bytes an entry).
    logits = 2 * seqs * info.vocab_size + DRAW_FLOATS * info.vocab_size
    samplers = 5 * seqs * info.vocab_size
    if attention_kernel:
        total = 4 * (tokens * per_token + info.n_heads * context + logits)
    else:
        scores = info.n_heads * tokens * context
        gathered = 2 * seqs * context * info.kv_dim
        total = 4 * (tokens * per_token + scores + gathered + logits) + tokens * context
    total += samplers
    # The same step's peak growth moves from run to run with where the allocator puts its
    # buffers (measured after the load's first step, whose one-time state is runtime), and
    # a measured peak has exceeded the formula itself: a plan bounds the peak, so it keeps
    # an eighth more. A server's serving peak exceeded the plan until it counted the
    # sampling terms above; `slotserve bench memory` measures that peak against the plan
    # (docs/BENCHMARKS.md). The RoPE tables are exact bytes, built before any step.
    return total + total // 8 + HEAP_REFAULT + info.rope_table_bytes(context)


@dataclass(frozen=True)
class CapacityPlan:
    """The memory plan of one engine: the ``ledger``'s arenas and this config's KV pool and
    activations, against ``memory_budget`` (a total) or ``memory_map`` (a limit per arena).
    ``attention_kernel``: the engine attends with the compiled kernel (no score block
    materialised: `activation_bytes`); False plans torch's attention, which needs more."""

    info: ModelInfo
    kv: KVConfig
    ledger: MemoryLedger = field(default_factory=MemoryLedger)
    max_batch_tokens: int = 256
    memory_budget: int | None = None
    memory_map: MemoryMap | None = None
    prefix_cache_bytes: int = 0
    attention_kernel: bool = False

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_map is not None:
            raise ValueError("give memory_budget or memory_map, not both")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes={self.prefix_cache_bytes} must be >= 0")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} must be >= 1")

    @property
    def weight_bytes(self) -> int:
        return self.ledger.bytes("weights")

    @property
    def runtime_bytes(self) -> int:
        return self.ledger.bytes("runtime")

    @property
    def load_peak_bytes(self) -> int:
        """The ledger's highest transient peak (a load's: 0 when none was measured)."""
        return self.ledger.peak_bytes

    @property
    def kv_bytes(self) -> int:
        cell = kv_cell_bytes(self.info, self.kv)
        rules = layer_rules(self.info, self.kv)
        return sum(
            2 * len(layers) * cells_per_layer(r, self.kv) * cell for r, layers in rules.items()
        )

    @property
    def bytes_per_session(self) -> int:
        """KV bytes one session can occupy at ``max_context`` (its worst case)."""
        cell = kv_cell_bytes(self.info, self.kv)
        rules = layer_rules(self.info, self.kv)
        return sum(
            2 * len(layers) * cells_per_session(r, self.kv) * cell for r, layers in rules.items()
        )

    @property
    def parks_slots(self) -> bool:
        """Whether the pool has flat rows, whose prefix snapshots are parked slots
        (`KVPool.parks_slots`): nothing copied, nothing pinned beyond the pool."""
        return any(kind == "flat" for kind, _ in layer_rules(self.info, self.kv))

    @property
    def prefix_copy_bytes(self) -> int:
        """The most the prefix cache's snapshots copy out of the pool: with rings to copy
        (sliding-window layers of the cell layout, the ring layout), its whole budget (the
        cache evicts before its copies and pinned blocks pass it); 0 otherwise, its
        snapshots then only share blocks inside the pool (cell) or park slots (flat rows:
        `KVPool.parks_slots`)."""
        kinds = {kind for kind, _ in layer_rules(self.info, self.kv)}
        copies = not self.parks_slots and kinds != {"cell"}
        return self.prefix_cache_bytes if copies else 0

    @property
    def arenas(self) -> dict[str, int]:
        """Bytes by arena: the ledger's, then ``kv`` (the pool plus the prefix cache's
        copies, `prefix_copy_bytes`) and ``activations``, computed from the config."""
        arenas = self.ledger.arenas()
        computed = {
            "kv": self.kv_bytes + self.prefix_copy_bytes,
            "activations": activation_bytes(
                self.info, self.kv, self.max_batch_tokens, self.attention_kernel
            ),
        }
        for name, nbytes in computed.items():
            arenas[name] = arenas.get(name, 0) + nbytes
        return arenas

    @property
    def worst_case_bytes(self) -> int:
        """The serving worst case: every arena at once."""
        return sum(self.arenas.values())

    @property
    def required_bytes(self) -> int:
        """What the budget must hold: the serving worst case, or the load's peak where that
        is higher."""
        return max(self.worst_case_bytes, self.load_peak_bytes)

    @property
    def budget(self) -> int | MemoryMap | None:
        return self.memory_map if self.memory_map is not None else self.memory_budget

    def problems(self) -> list[str]:
        """Why the plan does not fit its budget (`budget_problems`); empty when it fits."""
        return budget_problems(self.arenas, self.load_peak_bytes, self.budget)

    @property
    def fits(self) -> bool:
        return not self.problems()

    @property
    def prefix_cache(self) -> dict[str, Any] | None:
        """How much of the KV pool the prefix cache may pin (None: the cache is off). Its
        snapshots live inside the pool, not beside it: they hold blocks no session is using,
        and the cache evicts before a request is refused, so it adds no bytes to the plan;
        at most ``pinnable_bytes`` (``pool_fraction`` of the pool, whole blocks) are held
        while idle, and a request admitted at ``max_seqs`` worst case makes it yield. A
        model with sliding-window layers (or the ring layout, whose snapshots hold no
        blocks) also copies its ring rows into each snapshot (``ring_copy_bytes`` each):
        outside the pool, inside the same budget, which the plan counts in the ``kv`` arena
        (`prefix_copy_bytes`). The flat layout copies nothing (``parks_slots``): a finished
        session's slot is its snapshot until a request needs the slot."""
        if not self.prefix_cache_bytes:
            return None
        pool = self.kv_bytes
        block = pool // max(self.kv.total_blocks, 1) if self.kv.layout == "cell" else 0
        pinnable = min(self.prefix_cache_bytes // block * block, pool) if block else 0
        cell = kv_cell_bytes(self.info, self.kv)
        rules = layer_rules(self.info, self.kv)
        parks = self.parks_slots
        ring_copy = 0 if parks else sum(
            2 * len(layers) * cells_per_session(r, self.kv) * cell for r, layers in rules.items()
            if r[0] in ("ring", "ring-full")
        )  # fmt: skip
        return {
            "parks_slots": parks,
            "ring_copy_bytes": ring_copy,
            "copy_bytes": self.prefix_copy_bytes,
            "budget_bytes": self.prefix_cache_bytes,
            "pinnable_bytes": pinnable,
            "pool_fraction": pinnable / pool if pool else 0.0,
            "block_bytes": block,
            "blocks": pinnable // block if block else 0,
        }

    @property
    def headroom(self) -> int | None:
        if self.memory_map is not None:
            return self.memory_map.total - self.required_bytes
        return None if self.memory_budget is None else self.memory_budget - self.required_bytes

    def with_kv(self, **changes: Any) -> CapacityPlan:
        return dataclasses.replace(self, kv=dataclasses.replace(self.kv, **changes))

    def max_seqs_that_fit(self, limit: int = 4096) -> int:
        """Largest max_seqs (at this max_context) that fits; 0 if none does."""
        return _largest(lambda n: self.with_kv(max_seqs=n, num_blocks=None).fits, 1, limit)

    def max_context_that_fits(self) -> int:
        """Largest max_context (at this max_seqs, a multiple of the block size for the cell
        layout) that fits; 0 if none does."""
        step = self.kv.block_size if self.kv.layout == "cell" else 1
        top = self.info.max_context // step
        found = _largest(lambda n: self.with_kv(max_context=n * step, num_blocks=None).fits, 1, top)
        return found * step

    def check(self) -> None:
        """Raise `PlanError` unless the plan fits, naming the levers that would make it (or
        the arena a memory map leaves out or holds too little of)."""
        problems = self.problems()
        if not problems:
            return
        refusal = self.runtime_refusal()
        if refusal is not None:
            raise refusal
        if self.memory_map is not None:
            missing = [p for p in problems if "has no limit" in p]
            if missing:
                raise PlanError(f"{missing[0]} (--memory-map names every arena)")
        arenas = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.arenas.items())
        limit = (
            f"the budget {format_bytes(self.memory_budget)}"
            if self.memory_budget is not None
            else f"the memory map {self.memory_map} ({'; '.join(problems)})"
        )
        grammars = self.ledger.bytes("grammars")
        raise PlanError(
            f"the plan needs {format_bytes(self.worst_case_bytes)} ({arenas}) and does not fit "
            f"{limit}. Largest max_seqs that fits at max_context={self.kv.max_context}: "
            f"{self.max_seqs_that_fit()}; largest max_context that fits at "
            f"max_seqs={self.kv.max_seqs}: {self.max_context_that_fits()}."
            + (
                f" Or lower the grammars arena, {format_bytes(grammars)} "
                "(serve --grammar-cache-bytes)."
                if grammars
                else ""
            )
        )

    def runtime_refusal(self) -> PlanError | None:
        """The `PlanError` of a budget under the runtime arena alone (the interpreter,
        torch and the libraries, measured), or under the load's peak (a `LoadPeakError`);
        None otherwise. No context or concurrency can fit either, so it names the number,
        the budget and the budget this plan needs."""
        limit = self.memory_budget
        if self.memory_map is not None:
            limit = self.memory_map.total
        runtime = self.runtime_bytes
        if limit is not None and self.load_peak_bytes > limit >= runtime:
            return LoadPeakError(
                f"loading the model peaks at {format_bytes(self.load_peak_bytes)} anonymous "
                f"(the process with the load's transient copies, measured), more than the "
                f"budget {format_bytes(limit)}: the process could be killed while loading, "
                "whatever the context or concurrency. Raise the budget to at least "
                f"{format_bytes(self.required_bytes)}, or load smaller weights (--weights "
                "gguf keeps a GGUF file's quantised blocks)",
                self.load_peak_bytes,
                limit,
            )
        if self.memory_budget is None or runtime <= self.memory_budget:
            return None
        return PlanError(
            f"the runtime alone (the interpreter, torch and the libraries, measured) holds "
            f"{format_bytes(runtime)} anonymous, more than the budget "
            f"{format_bytes(self.memory_budget)}: no context or concurrency fits. Raise the "
            f"budget to at least {format_bytes(self.required_bytes)} (this plan's whole worst "
            "case), or plan the model's arenas only (budget_scope='model', --budget-scope model)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "layout": self.kv.layout,
            "kv_dtype": self.kv.dtype,
            "max_seqs": self.kv.max_seqs,
            "max_context": self.kv.max_context,
            "block_size": self.kv.block_size,
            "arenas": self.arenas,
            "bytes_per_session": self.bytes_per_session,
            "worst_case_bytes": self.worst_case_bytes,
            "load_peak_bytes": self.load_peak_bytes,
            "required_bytes": self.required_bytes,
            "memory_budget": self.memory_budget,
            "memory_map": dict(self.memory_map.limits) if self.memory_map else None,
            "ledger": self.ledger.to_dict(),
            "headroom_bytes": self.headroom,
            "max_seqs_that_fit": self.max_seqs_that_fit(),
            "max_context_that_fits": self.max_context_that_fits(),
            "prefix_cache": self.prefix_cache,
        }


def _largest(fits: Any, low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n), assuming fits is monotone; low - 1 if none."""
    if high < low or not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
