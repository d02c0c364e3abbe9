"""`PressureSource`: a device-pressure signal (thermal zones, a file, or any callable).

Level 0.0 is idle, 1.0 is the threshold of trouble. Under pressure the engine pauses
background work: background admission (refusals say ``pressure``) and the background
requests already running, which take no step until it clears (`Scheduler.select`: they
stay bound, their KV kept, and go on where they stopped); other work goes on in batches
of half the slots. `pressure_from` turns the ``serve --pressure`` spelling (``auto``,
``thermal``, ``file:PATH``, ``off``) into a source; ``auto`` (serve's default) is
``thermal`` where a thermal zone can be read and ``off`` elsewhere, and logs which.
"""

from __future__ import annotations

import glob
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path

THERMAL_GLOB = "/sys/class/thermal/thermal_zone*/temp"
log = logging.getLogger("slotserve")


class PressureSource:
    """A pressure level: ``read``'s value, or without it the thermal zones matching
    ``thermal_glob`` (the hottest as a fraction of ``hot_celsius``); under pressure at
    ``threshold`` and above."""

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
        """Whether the level has reached the threshold (raises if ``read`` does)."""
        return self.level() >= self.threshold

    def reading(self) -> float:
        """`level`, or 0.0 when the signal cannot be read (for monitoring, which must not
        fail because the signal does; the engine logs such failures where it acts)."""
        try:
            return self.level()
        except Exception:
            return 0.0


class FileLevel:
    """A pressure level that another process writes to a file, as one number (``0.3``).

    A missing file reads as 0.0 (no signal yet). Text that is not a finite number (a
    writer caught mid-write) keeps the last good level, so a torn write neither raises
    nor drops the pressure. Each kind of trouble is logged once until the file reads
    well again.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._last = 0.0
        self._complained: str | None = None
        self._lock = threading.Lock()  # the engine thread and stats() both read

    def __call__(self) -> float:
        with self._lock:
            try:
                text = self.path.read_text().strip()
            except FileNotFoundError:
                self._complain("missing", "%s does not exist; pressure taken as 0.0")
                self._last = 0.0
                return 0.0
            except OSError as exc:
                self._complain("unreadable", f"%s cannot be read ({exc}); keeping the last level")
                return self._last
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                self._complain("garbled", f"%s holds {text!r}, not a number; keeping the last")
                return self._last
            self._complained = None
            self._last = value
            return value

    def _complain(self, kind: str, message: str) -> None:
        if self._complained != kind:
            self._complained = kind
            log.warning("pressure file " + message, self.path)


PRESSURE_SPELLINGS = "auto, thermal, file:PATH or off"


def readable_zones(thermal_glob: str = THERMAL_GLOB) -> list[tuple[str, float]]:
    """Each thermal zone whose temperature can be read now: its name (the zone's
    directory, with its ``type`` where the kernel gives one) and degrees Celsius."""
    zones = []
    for path in sorted(glob.glob(thermal_glob)):
        try:
            celsius = int(Path(path).read_text().strip()) / 1000.0
        except (OSError, ValueError):
            continue
        zone = Path(path).parent
        try:
            name = f"{zone.name} ({(zone / 'type').read_text().strip()})"
        except OSError:
            name = zone.name
        zones.append((name, celsius))
    return zones


def check_spelling(spec: str) -> None:
    """`ValueError` unless ``spec`` is one of `PRESSURE_SPELLINGS` (reads nothing)."""
    if spec in ("auto", "thermal", "off"):
        return
    if spec.startswith("file:") and len(spec) > len("file:"):
        return
    raise ValueError(f"--pressure {spec!r}: use {PRESSURE_SPELLINGS}")


def pressure_from(
    spec: str, threshold: float = 1.0, thermal_glob: str = THERMAL_GLOB
) -> PressureSource | None:
    """``"thermal"`` (the thermal zones of ``thermal_glob``), ``"file:PATH"``
    (`FileLevel`), ``"off"`` (None: no signal), or ``"auto"``: ``"thermal"`` where a zone
    can be read now, else ``"off"``, logged either way → a `PressureSource`."""
    check_spelling(spec)
    if spec == "off":
        return None
    if spec.startswith("file:"):
        return PressureSource(FileLevel(spec.removeprefix("file:")), threshold=threshold)
    source = PressureSource(threshold=threshold, thermal_glob=thermal_glob)
    if spec == "auto":
        zones = readable_zones(thermal_glob)
        if not zones:
            log.info(
                "pressure off: no readable thermal zone (%s); --pressure file:PATH gives "
                "a signal of your own",
                thermal_glob,
            )
            return None
        named = ", ".join(f"{name} at {celsius:.0f} °C" for name, celsius in zones)
        log.info(
            "pressure: thermal, from %s; background work pauses while the hottest reaches "
            "%.0f °C (--pressure off: never)",
            named,
            source.hot_celsius * threshold,
        )
    return source
