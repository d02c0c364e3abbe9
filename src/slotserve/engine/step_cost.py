"""`StepCost`: what a step's rows cost on this machine and model, fitted to the steps run.

Speculation weighs a draft's expected tokens against the rows it adds to the target's step
(`slotserve.engine.speculate`) and, with a draft model, against the draft model's own steps
(`slotserve.engine.draft`); both fit their steps with this.

A wrong fit is what makes speculation slow a batch down: a fit that takes rows to be free
drafts at length where every row costs nearly a step. So the fit is kept cautious where the
steps run so far cannot tell: its slope leans on the prior (half of a step's time per row)
while the steps seen vary little in size, one step's time can move it only so far (a step
the OS descheduled is not a trend), rows past the largest step seen are priced at no less
than the prior's rate at that step, and each thread count the kernels run on (the thread
governor, `slotserve.native.contention`, changes it with the machine's load) has a fit of
its own, since a row costs another share of a step on one thread than on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How fast the step-cost fit forgets older steps (per step).
COST_DECAY = 0.98
# How much spread in step sizes (rows squared) the prior slope weighs as, against the
# spread of the steps seen: with less, the slope stays near the prior.
PRIOR_SPREAD = 1.0
# Steps (decayed count) after which one step's time is held to within this factor of what
# the fit predicts for it, so that one outlier cannot turn the slope.
SETTLED_STEPS = 5.0
OUTLIER_FACTOR = 2.0


@dataclass
class StepCost:
    """What a decode step of ``rows`` rows costs, as ``fixed + per_row * rows`` seconds,
    fitted (least squares, recent steps weighing most) to the steps this engine ran at
    the current thread count (`use`). The slope is drawn towards the prior (half of a
    step's time per row) by `PRIOR_SPREAD`, and rows beyond the largest step seen cost at
    least the prior's rate there (`seconds`)."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    largest: int = 0  # the most rows of a step seen at this thread count
    threads: int = 0  # the thread count these sums are of
    _others: dict[int, tuple[float, float, float, float, float, int]] = field(
        default_factory=dict, repr=False
    )

    def use(self, threads: int) -> None:
        """Fit (and price) the steps of ``threads`` threads from now on; the sums of the
        previous count are kept for when it comes back."""
        if threads == self.threads:
            return
        self._others[self.threads] = (self.n, self.x, self.y, self.xx, self.xy, self.largest)
        state = self._others.pop(threads, (0.0, 0.0, 0.0, 0.0, 0.0, 0))
        self.n, self.x, self.y, self.xx, self.xy, self.largest = state
        self.threads = threads

    def observe(self, rows: int, seconds: float) -> None:
        if self.n >= SETTLED_STEPS:
            predicted = self.seconds(rows)
            seconds = min(max(seconds, predicted / OUTLIER_FACTOR), predicted * OUTLIER_FACTOR)
        decay = COST_DECAY
        self.n = self.n * decay + 1
        self.x = self.x * decay + rows
        self.y = self.y * decay + seconds
        self.xx = self.xx * decay + rows * rows
        self.xy = self.xy * decay + rows * seconds
        self.largest = max(self.largest, rows)

    def line(self) -> tuple[float, float]:
        """(fixed, per_row) seconds; (1, 1) before any step (only ratios matter)."""
        if self.n == 0:
            return 1.0, 1.0
        mean_x, mean_y = self.x / self.n, self.y / self.n
        variance = max(self.xx / self.n - mean_x**2, 0.0)
        covariance = self.xy / self.n - mean_x * mean_y
        prior = 0.5 * mean_y / mean_x
        per_row = (covariance + PRIOR_SPREAD * prior) / (variance + PRIOR_SPREAD)
        per_row = min(max(per_row, 0.0), mean_y / mean_x)
        return max(mean_y - per_row * mean_x, 0.0), per_row

    def seconds(self, rows: int) -> float:
        """A step of ``rows`` rows: the line within the steps seen; past the largest, each
        further row at no less than half of that step's time per row (the prior's rate)."""
        fixed, per_row = self.line()
        if self.largest == 0 or rows <= self.largest:
            return fixed + per_row * rows
        at_largest = fixed + per_row * self.largest
        beyond = max(per_row, 0.5 * at_largest / self.largest)
        return at_largest + beyond * (rows - self.largest)
