"""`BenchOptions`: the options some scenarios take, validated once, and the keyword
arguments each scenario receives from them (`scenario_kwargs`).

The one way options reach a scenario: `slotserve.bench.run_bench` passes its
``options`` through here, and the command line builds its ``BenchOptions`` from flags. This
module owns which scenario takes which option; the scenarios own what an option does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotserve.engine.presets import PRESET_NAMES, preset_config
from slotserve.memory import parse_bytes
from slotserve.model import Model

# Which scenarios each option applies to (``memory_budget`` goes with ``preset``).
APPLIES_TO: dict[str, tuple[str, ...]] = {
    "shares": ("mixed",),
    "preset": ("mixed", "bargein"),
    "reference": ("executors", "servers"),
    "streams": ("servers",),
    "draft_model": ("speculative",),
}


@dataclass(frozen=True)
class BenchOptions:
    """Options of the scenarios that take them; None leaves the scenario's default.

    ``shares``: the background minimum shares ``mixed`` sweeps against the chat turn's ITL,
    each in [0, 1). ``preset``: the workload preset (`slotserve.engine.presets`) whose engine shape
    replaces the scenario's own in ``mixed`` and ``bargein``, sized for ``memory_budget``
    (bytes or text such as ``"2GiB"``; None: the preset's default budget). ``reference``:
    the model the torch executor runs beside a bundle in ``executors``, and llama-server's
    GGUF in ``servers`` (None: the file the bundle was exported from). ``streams``: the
    numbers of concurrent streams ``servers`` runs, each a row (None: 1, 2, 4 and 8).
    ``draft_model``: the draft model ``speculative`` also runs each workload with (its
    weights held as ``draft_weights``, None: ``"auto"``), beside n-gram drafts.
    """

    shares: tuple[float, ...] | None = None
    preset: str | None = None
    memory_budget: int | str | None = None
    reference: str | None = None
    streams: tuple[int, ...] | None = None
    draft_model: str | None = None
    draft_weights: str | None = None

    def __post_init__(self) -> None:
        if self.draft_weights is not None and self.draft_model is None:
            raise ValueError(
                f"draft_weights={self.draft_weights!r} is how draft_model's weights are held: "
                "give draft_model too"
            )
        if self.streams is not None:
            if not self.streams:
                raise ValueError("streams=() is empty; give at least one count of streams")
            if min(self.streams) < 1 or len(set(self.streams)) < len(self.streams):
                raise ValueError(
                    f"streams={self.streams}: give each count of streams once, each at least 1"
                )
        if self.shares is not None:
            if not self.shares:
                raise ValueError("shares=() is empty; give at least one share in [0, 1)")
            bad = [share for share in self.shares if not 0.0 <= share < 1.0]
            if bad:
                raise ValueError(f"shares: {bad[0]} is not in [0, 1)")
        if self.preset is not None and self.preset not in PRESET_NAMES:
            raise ValueError(f"preset={self.preset!r} is not one of {', '.join(PRESET_NAMES)}")
        if self.memory_budget is not None:
            if self.preset is None:
                raise ValueError(
                    f"memory_budget={self.memory_budget!r} sizes a preset: give preset too"
                )
            if isinstance(self.memory_budget, str):
                parse_bytes(self.memory_budget)  # fail here, with the parser's message

    def given(self) -> list[str]:
        """The names of the options set (``memory_budget`` counts as part of ``preset``)."""
        return [name for name in APPLIES_TO if getattr(self, name) is not None]

    def check_applies(self, scenarios: list[str]) -> None:
        """Raise ValueError for an option that none of ``scenarios`` takes."""
        for name in self.given():
            if not set(APPLIES_TO[name]) & set(scenarios):
                raise ValueError(
                    f"{name} applies to the scenario(s) {', '.join(APPLIES_TO[name])}, "
                    f"not {', '.join(scenarios)}"
                )


def scenario_kwargs(scenario: str, options: BenchOptions, model: Model) -> dict[str, Any]:
    """The keyword arguments ``scenario`` takes from ``options`` (beyond model, repeats)."""
    kwargs: dict[str, Any] = {}
    if options.shares is not None and scenario in APPLIES_TO["shares"]:
        kwargs["shares"] = options.shares
    if options.preset is not None and scenario in APPLIES_TO["preset"]:
        kwargs["config"] = preset_config(options.preset, model, options.memory_budget)
    if options.reference is not None and scenario in APPLIES_TO["reference"]:
        from slotserve.artifact import load

        kwargs["reference"] = load(options.reference)
    if options.streams is not None and scenario in APPLIES_TO["streams"]:
        kwargs["levels"] = tuple(sorted(options.streams))
    if options.draft_model is not None and scenario in APPLIES_TO["draft_model"]:
        from slotserve.artifact import load

        kwargs["draft"] = load(options.draft_model, weights=options.draft_weights or "auto")
    return kwargs
