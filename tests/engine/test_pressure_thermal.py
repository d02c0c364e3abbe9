"""``--pressure thermal`` on a fake sysfs tree: the reader takes the hottest thermal zone as
a fraction of ``hot_celsius``, skips zones it cannot read, and the engine pauses background
admission while the tree is hot."""

from __future__ import annotations

from pathlib import Path

import pytest

import slotserve as ss
from slotserve.cli import build_parser
from slotserve.cli.flags import pressure_source
from slotserve.engine.pressure import THERMAL_GLOB, PressureSource

SHORT = ss.SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)


def fake_sysfs(root: Path, temps: dict[str, str]) -> str:
    """``root/class/thermal/thermal_zone*/temp`` files holding ``temps`` (millidegrees, as
    the kernel writes them), and the glob that reads them."""
    thermal = root / "class" / "thermal"
    for zone, text in temps.items():
        (thermal / zone).mkdir(parents=True, exist_ok=True)
        (thermal / zone / "temp").write_text(text)
    (thermal / "cooling_device0").mkdir(parents=True, exist_ok=True)  # not a zone
    (thermal / "cooling_device0" / "cur_state").write_text("3\n")
    return str(thermal / "thermal_zone*" / "temp")


def test_the_hottest_readable_zone_sets_the_level(tmp_path: Path) -> None:
    pattern = fake_sysfs(
        tmp_path,
        {"thermal_zone0": "45000\n", "thermal_zone1": "91000\n", "thermal_zone2": "garbled\n"},
    )
    (tmp_path / "class" / "thermal" / "thermal_zone3" / "temp").mkdir(parents=True)  # unreadable
    source = PressureSource(thermal_glob=pattern)
    assert source.level() == pytest.approx(91.0 / 85.0)
    assert source.under_pressure()
    assert PressureSource(thermal_glob=pattern, hot_celsius=100.0).under_pressure() is False
    assert PressureSource(thermal_glob=str(tmp_path / "none*" / "temp")).level() == 0.0


def test_serve_pressure_thermal_reads_the_thermal_zones(tmp_path: Path, tiny: ss.Model) -> None:
    """The flag's source reads the kernel's thermal zones; pointed at a fake tree, a hot
    zone pauses background admission, and cooling resumes it."""
    args = build_parser().parse_args(["serve", "--pressure", "thermal"])
    source = pressure_source(args)
    assert isinstance(source, PressureSource) and source.thermal_glob == THERMAL_GLOB
    source.thermal_glob = fake_sysfs(tmp_path, {"thermal_zone0": "90000\n"})
    with ss.Engine(tiny, ss.EngineConfig(max_seqs=2, max_context=64), pressure=source) as engine:
        assert engine.stats().pressure_level == pytest.approx(90.0 / 85.0)
        with pytest.raises(ss.AdmissionRefused) as refused:
            engine.submit([5, 6], SHORT, priority="background")
        assert refused.value.reason == "pressure"
        assert engine.submit([5, 6], SHORT, priority="interactive").result().reason == "length"
        (tmp_path / "class" / "thermal" / "thermal_zone0" / "temp").write_text("40000\n")
        assert engine.submit([5, 6], SHORT, priority="background").result().reason == "length"
        assert engine.stats().refusals == {"pressure": 1}
