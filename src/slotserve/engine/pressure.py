"""`PressureSource`: a device-pressure signal (thermal zones, or any callable).

Level 0.0 is idle, 1.0 is the threshold of trouble. Under pressure the engine pauses
background admission and halves its batches.
"""

from __future__ import annotations

import glob
from collections.abc import Callable

THERMAL_GLOB = "/sys/class/thermal/thermal_zone*/temp"


class PressureSource:
    def __init__(
        self,
        read: Callable[[], float] | None = None,
        *,
        threshold: float = 1.0,
        hot_celsius: float = 85.0,
        thermal_glob: str = THERMAL_GLOB,
    ) -> None:
        self._read = read
        self.threshold = threshold
        self.hot_celsius = hot_celsius
        self.thermal_glob = thermal_glob

    def level(self) -> float:
        """The current pressure level (the callable's value, or the hottest thermal zone
        as a fraction of ``hot_celsius``; 0.0 when nothing can be read)."""
        if self._read is not None:
            return float(self._read())
        temps = []
        for path in glob.glob(self.thermal_glob):
            try:
                with open(path) as handle:
                    temps.append(int(handle.read().strip()) / 1000.0)
            except (OSError, ValueError):
                continue
        return max(temps) / self.hot_celsius if temps else 0.0

    def under_pressure(self) -> bool:
        return self.level() >= self.threshold
