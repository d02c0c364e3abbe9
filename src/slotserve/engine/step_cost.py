"""`StepCost`: what a step's rows cost on this machine and model, fitted to the steps run.

Speculation weighs a draft's expected tokens against the rows it adds to the target's step
(`slotserve.engine.speculate`) and, with a draft model, against the draft model's own steps
(`slotserve.engine.draft`); both fit their steps with this.
"""

from __future__ import annotations

from dataclasses import dataclass

# How fast the step-cost fit forgets older steps (per step).
COST_DECAY = 0.98


@dataclass
class StepCost:
    """What a decode step of ``rows`` rows costs, as ``fixed + per_row * rows`` seconds,
    fitted (least squares, recent steps weighing most) to the steps this engine ran. Before
    steps of different sizes were seen, half of a step's time is taken to be per row."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        decay = COST_DECAY
        self.n = self.n * decay + 1
        self.x = self.x * decay + rows
        self.y = self.y * decay + seconds
        self.xx = self.xx * decay + rows * rows
        self.xy = self.xy * decay + rows * seconds

    def line(self) -> tuple[float, float]:
        """(fixed, per_row) seconds; (1, 1) before any step (only ratios matter)."""
        if self.n == 0:
            return 1.0, 1.0
        mean_x, mean_y = self.x / self.n, self.y / self.n
        variance = self.xx / self.n - mean_x**2
        if variance < 0.25:  # steps of one size so far: the prior
            per_row = 0.5 * mean_y / mean_x
        else:
            per_row = max((self.xy / self.n - mean_x * mean_y) / variance, 0.0)
        return max(mean_y - per_row * mean_x, 0.0), per_row

    def seconds(self, rows: int) -> float:
        fixed, per_row = self.line()
        return fixed + per_row * rows
