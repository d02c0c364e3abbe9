"""What one generation reports: `Stats` (ExecuTorch's runner stats) and `GenerationResult`.

`Stats` mirrors ExecuTorch 1.5.1's runner ``Stats`` (``extension/llm/runner/stats.h`` and
its Python binding): the same fields with the same meanings, its methods (``reset``,
``to_json_string``, ``on_sampling_begin``/``on_sampling_end`` and the C++ side's
``on_model_execution_begin``/``on_model_execution_end``), and `Stats.to_json` writes what
its ``stats_to_json_string`` writes (names, order, the two per-second rates and when they
are left out). docs/RUNNER.md sets the two side by side.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from typing import ClassVar

from slotserve.engine.timings import RequestTimings


def now_ms() -> int:
    """Milliseconds on a monotonic clock (differences are meaningful, not the origin)."""
    return time.monotonic_ns() // 1_000_000


def _ms(seconds: float) -> int:
    """Seconds on the engine's clock (``time.monotonic``) as `now_ms` reads it."""
    return int(seconds * 1000)


@dataclass
class Stats:
    """Timestamps (ms, monotonic) and counts of one generation: ExecuTorch's runner
    ``Stats``.

    As in 1.5.1, ``num_generated_tokens`` counts the tokens of the decode steps: every
    sampled token (an EOS that ended the turn included) except the first, which prefill
    produces, so ``len(result.tokens)`` is one more for a run that hit its length.
    ``prompt_eval_end_ms`` and ``first_token_ms`` are the moment that first token was
    sampled; the decode rate is ``num_generated_tokens`` over the time after it.

    The model-execution fields are the time inside the model's forward pass (embedding,
    layers and head: `Executor.step`), timed by `TextLLMRunner`'s executor around every
    step of the generation, prefill chunks and decodes alike (its engine runs one
    request, so every step is this generation's): ``model_execution_start_ms`` and
    ``model_execution_end_ms`` bound the latest forward, and
    ``aggregate_model_execution_time_ms`` sums all of them. The sums (sampling and
    execution) add nanoseconds and keep whole milliseconds, where ExecuTorch adds each
    call's whole milliseconds (a sub-millisecond call adds 0 there). The GPU fields are
    None ("not available", ExecuTorch's sentinels) and, as there, are then left out of the
    JSON.
    """

    SCALING_FACTOR_UNITS_PER_SECOND: ClassVar[int] = 1000
    model_load_start_ms: int = 0
    model_load_end_ms: int = 0
    # Before the prompt is tokenised: inference time includes encoding, as ExecuTorch's.
    inference_start_ms: int = 0
    token_encode_end_ms: int = 0
    model_execution_start_ms: int = 0
    model_execution_end_ms: int = 0
    prompt_eval_end_ms: int = 0
    first_token_ms: int = 0
    inference_end_ms: int = 0
    aggregate_sampling_time_ms: int = 0
    aggregate_model_execution_time_ms: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    gpu_total_bytes: int | None = None
    gpu_free_before_load_bytes: int | None = None
    gpu_free_after_load_bytes: int | None = None
    gpu_free_after_generate_bytes: int | None = None
    gpu_peak_usage_mb: float | None = None
    # slotserve's own (not in ExecuTorch's JSON): prompt positions the engine computed for
    # this call and those it restored from the prefix cache (the conversation so far).
    prompt_tokens_computed: int = 0
    prompt_tokens_restored: int = 0
    # The open sampling and forward windows (monotonic ns) and the nanoseconds of each sum
    # not yet counted in its whole milliseconds.
    _sampling_began_ns: int | None = field(default=None, init=False, repr=False, compare=False)
    _sampling_rest_ns: int = field(default=0, init=False, repr=False, compare=False)
    _execution_began_ns: int | None = field(default=None, init=False, repr=False, compare=False)
    _execution_rest_ns: int = field(default=0, init=False, repr=False, compare=False)

    def reset(self, all_stats: bool = False) -> None:
        """Zero the generation's figures, keeping the model load times unless
        ``all_stats`` (ExecuTorch's ``Stats::reset``: a warm-up's reset keeps the load
        that preceded it). The GPU figures go back to "not available". ExecuTorch's reset
        leaves ``token_encode_end_ms`` as it was; this one zeroes it with the rest."""
        loaded = (self.model_load_start_ms, self.model_load_end_ms)
        fresh = Stats()
        for name in _RESET_FIELDS:
            setattr(self, name, getattr(fresh, name))
        if not all_stats:
            self.model_load_start_ms, self.model_load_end_ms = loaded

    def on_sampling_begin(self) -> None:
        """Open a sampling window (ExecuTorch's ``on_sampling_begin``)."""
        self._sampling_began_ns = time.monotonic_ns()

    def on_sampling_end(self) -> None:
        """Close the sampling window and add it to ``aggregate_sampling_time_ms``; without
        an open window, nothing is added."""
        began, self._sampling_began_ns = self._sampling_began_ns, None
        if began is not None:
            total = self._sampling_rest_ns + time.monotonic_ns() - began
            self.aggregate_sampling_time_ms += total // 1_000_000
            self._sampling_rest_ns = total % 1_000_000

    def on_model_execution_begin(self) -> None:
        """Open a forward window: ``model_execution_start_ms`` is now (ExecuTorch's C++
        ``on_model_execution_begin``)."""
        self._execution_began_ns = now = time.monotonic_ns()
        self.model_execution_start_ms = now // 1_000_000

    def on_model_execution_end(self) -> None:
        """Close the forward window: ``model_execution_end_ms`` is now and the window is
        added to ``aggregate_model_execution_time_ms``; without an open window, nothing."""
        began, self._execution_began_ns = self._execution_began_ns, None
        if began is None:
            return
        now = time.monotonic_ns()
        self.model_execution_end_ms = now // 1_000_000
        total = self._execution_rest_ns + now - began
        self.aggregate_model_execution_time_ms += total // 1_000_000
        self._execution_rest_ns = total % 1_000_000

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens the engine computed over inference start → prompt eval end (a span
        that includes restoring a cached prefix); None for an empty span. Restored tokens
        are not counted: a repeated prompt restores all but one and computes that one.
        Stats made by hand, with no engine counts, count ``num_prompt_tokens``."""
        span = self.prompt_eval_end_ms - self.inference_start_ms
        if span <= 0:
            return None
        recorded = self.prompt_tokens_computed or self.prompt_tokens_restored
        computed = self.prompt_tokens_computed if recorded else self.num_prompt_tokens
        return computed / span * self.SCALING_FACTOR_UNITS_PER_SECOND

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated (decode-step) tokens over prompt eval end → inference end; None for an
        empty span."""
        span = self.inference_end_ms - self.prompt_eval_end_ms
        if span <= 0:
            return None
        return self.num_generated_tokens / span * self.SCALING_FACTOR_UNITS_PER_SECOND

    def record_engine_timings(self, timings: RequestTimings, *, first_token: bool = True) -> None:
        """Fill what the engine measured for the request: prompt eval end and first token
        (when the first token was sampled, or the prefill's end if none was; not with
        ``first_token=False``, where the generation's first token came before the
        request: a prefilled prediction), the request's share of the batched sampling
        time, and its prompt positions computed and restored."""
        first = timings.token_times[0] if timings.token_times else timings.prefill_done
        if first is not None and first_token:
            self.prompt_eval_end_ms = self.first_token_ms = _ms(first)
        self.aggregate_sampling_time_ms = round(timings.sampling_time * 1000)
        self.prompt_tokens_computed = timings.prompt_tokens_computed
        self.prompt_tokens_restored = timings.prompt_tokens_restored

    def to_dict(self) -> dict[str, float | int]:
        """The object ``stats_to_json_string`` writes, key for key and in its order."""
        data: dict[str, float | int] = {}
        if (prefill := self.prefill_tokens_per_s) is not None:
            data["prefill_token_per_sec"] = prefill
        if (decode := self.decode_tokens_per_s) is not None:
            data["decode_token_per_sec"] = decode
        data.update(
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            model_load_start_ms=self.model_load_start_ms,
            model_load_end_ms=self.model_load_end_ms,
            inference_start_ms=self.inference_start_ms,
            inference_end_ms=self.inference_end_ms,
            model_execution_start_ms=self.model_execution_start_ms,
            model_execution_end_ms=self.model_execution_end_ms,
            prompt_eval_end_ms=self.prompt_eval_end_ms,
            first_token_ms=self.first_token_ms,
            aggregate_sampling_time_ms=self.aggregate_sampling_time_ms,
            aggregate_model_execution_time_ms=self.aggregate_model_execution_time_ms,
        )
        data.update(self._gpu_fields())
        data["SCALING_FACTOR_UNITS_PER_SECOND"] = self.SCALING_FACTOR_UNITS_PER_SECOND
        return data

    def _gpu_fields(self) -> dict[str, float | int]:
        # ExecuTorch writes the GPU figures only when the total is known, each one only
        # when it was measured.
        if self.gpu_total_bytes is None:
            return {}
        fields: dict[str, float | int | None] = {
            "gpu_total_bytes": self.gpu_total_bytes,
            "gpu_free_before_load_bytes": self.gpu_free_before_load_bytes,
            "gpu_free_after_load_bytes": self.gpu_free_after_load_bytes,
            "gpu_free_after_generate_bytes": self.gpu_free_after_generate_bytes,
            "gpu_peak_usage_mb": self.gpu_peak_usage_mb,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def to_json(self) -> str:
        """The stats as ExecuTorch's ``stats_to_json_string`` writes them: its field names
        (``prompt_tokens``, ``generated_tokens``, the timestamps, the per-second rates,
        ``SCALING_FACTOR_UNITS_PER_SECOND``) in its order, compact."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_json_string(self) -> str:
        """`to_json`, by the name of ExecuTorch's Python ``Stats.to_json_string``."""
        return self.to_json()


# What `Stats.reset` zeroes: every field but the scaling factor (a class constant).
_RESET_FIELDS = tuple(f.name for f in fields(Stats))


@dataclass(frozen=True)
class GenerationResult:
    """What a generation produced: token ids (EOS excluded), text, why it ended
    (stop, length, cancelled), the EOS token that ended it if any, and stats."""

    tokens: list[int]
    text: str
    finish_reason: str
    eos_token: int | None = None
    stats: Stats = field(default_factory=Stats)
