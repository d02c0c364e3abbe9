"""The declared bound of cancellation: a cancel waits for at most the step in flight.

`Engine.cancel` returns at once; the engine releases the request at the next batch
boundary, so the worst case is the cancel landing just as the largest step begins: that
step's time. `largest_step_tokens` is the largest step the config allows (``max_batch_tokens``,
and at most a prefill chunk per sequence), and `declare_cancel_bound` estimates its time
from the step times the engine measured, by step size: the worst measured step of that size
when one ran, else a straight line (a fixed cost plus a cost a token) through the worst
step of each measured size, else, with one size measured, that step scaled by tokens (no
fixed cost assumed: an upper estimate). Beside it, the measured cancel→release p99, so a
reader can see the bound hold. `slotserve.engine.probe.measure_cancel_bound` times the
model's own largest step before serving (what a plan states).

A workload whose cancellations are critical caps the step (``max_batch_tokens``), and so
the bound: the ``voice`` preset does (`slotserve.engine.presets`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from slotserve.engine.config import EngineConfig

Basis = Literal["measured", "extrapolated", "proportional", "unmeasured"]


@dataclass(frozen=True)
class CancelBound:
    """The worst-case cancel→release time (``estimate_s``: the time of a
    ``max_step_tokens`` step; None before any step was measured) and how it was estimated
    (``basis``: a step that large ``measured``, ``extrapolated`` over the measured sizes,
    scaled from one size, ``proportional``, or ``unmeasured``), beside the measured
    cancel→release latencies: their p99 and maximum over ``cancels_measured`` cancels."""

    max_step_tokens: int
    estimate_s: float | None
    basis: Basis
    measured_p99_s: float | None = None
    measured_max_s: float | None = None
    cancels_measured: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: the bound and what it rests on (for a plan or a log)."""
        if self.estimate_s is None:
            bound = f"one step of at most {self.max_step_tokens} tokens (no step measured yet)"
        else:
            bound = (
                f"{self.estimate_s * 1e3:.1f} ms (a {self.max_step_tokens}-token step, "
                f"{self.basis})"
            )
        line = f"worst-case cancel→release: {bound}"
        if self.measured_p99_s is not None:
            line += (
                f"; measured p99 {self.measured_p99_s * 1e3:.1f} ms over "
                f"{self.cancels_measured} cancels"
            )
        return line


def largest_step_tokens(config: EngineConfig) -> int:
    """The most tokens one step of ``config`` feeds: ``max_batch_tokens``, and at most one
    prefill chunk per live sequence (a decode feeds one)."""
    return min(config.max_batch_tokens, config.max_seqs * max(config.prefill_chunk, 1))


def declare_cancel_bound(
    max_step_tokens: int,
    step_seconds: Mapping[int, Sequence[float]],
    cancel_seconds: Sequence[float],
) -> CancelBound:
    """The bound for steps of at most ``max_step_tokens`` tokens, from measured step times
    by step size (tokens → seconds) and the measured cancel→release latencies."""
    worst = {tokens: max(times) for tokens, times in step_seconds.items() if times}
    estimate: float | None
    basis: Basis
    if not worst:
        estimate, basis = None, "unmeasured"
    elif max(worst) >= max_step_tokens:
        estimate = max(t for n, t in worst.items() if n >= max_step_tokens)
        basis = "measured"
    elif len(worst) == 1:
        ((tokens, seconds),) = worst.items()
        estimate, basis = seconds * max_step_tokens / tokens, "proportional"
    else:
        fixed, per_token = _line(worst)
        estimate = max(fixed + per_token * max_step_tokens, max(worst.values()))
        basis = "extrapolated"
    ordered = sorted(cancel_seconds)
    return CancelBound(
        max_step_tokens,
        estimate,
        basis,
        _p99(ordered),
        ordered[-1] if ordered else None,
        len(ordered),
    )


def _line(points: Mapping[int, float]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + per_token · tokens``, neither below 0."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    per_token = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    per_token = max(per_token, 0.0)
    return max(mean_y - per_token * mean_x, 0.0), per_token


def _p99(ordered: Sequence[float]) -> float | None:
    """The nearest-rank 99th percentile of sorted values."""
    if not ordered:
        return None
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]
