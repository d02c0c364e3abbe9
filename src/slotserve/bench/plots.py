"""PNG plots of bench results (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "plots need matplotlib: pip install 'slotserve[bench]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(scenario: str, result: dict[str, Any], path: Path) -> bool:
    """Write the plot of ``scenario`` to ``path``; False if it has none."""
    draw = {
        "single": _single,
        "layouts": _layouts,
        "concurrency": _concurrency,
        "mixed": _mixed,
        "memory": _memory,
    }.get(scenario)
    if draw is None:
        return False
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 3.6), dpi=110)
    draw(axes, result)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return True


def _errorbars(cells: list[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    medians = [c["median"] for c in cells]
    low = [c["median"] - c["min"] for c in cells]
    high = [c["max"] - c["median"] for c in cells]
    return medians, [low, high]


def _single(axes: Any, result: dict[str, Any]) -> None:
    rows = result["rows"]
    lengths = [r["prompt_tokens"] for r in rows]
    medians, spread = _errorbars([r["decode_tok_s"] for r in rows])
    axes.errorbar(lengths, medians, yerr=spread, marker="o", capsize=3, label="slotserve fp32")
    medians, spread = _errorbars([r["decode_tok_s_int8"] for r in rows])
    axes.errorbar(lengths, medians, yerr=spread, marker="o", capsize=3, label="slotserve int8")
    for name, baseline in result.get("baselines", {}).items():
        if "rows" in baseline:
            axes.plot(lengths, [r["decode_tok_s"] for r in baseline["rows"]], "s--", label=name)
    axes.set(
        xscale="log",
        xlabel="prompt tokens",
        ylabel="decode tok/s",
        title="single stream decode (median, min–max)",
    )
    axes.legend()


def _layouts(axes: Any, result: dict[str, Any]) -> None:
    for name, points in result["layouts"].items():
        contexts = [p["context"] for p in points]
        medians, spread = _errorbars([p["step_ms"] for p in points])
        axes.errorbar(contexts, medians, yerr=spread, marker="o", capsize=3, label=name)
    axes.set(xlabel="context (tokens)", ylabel="decode step (ms)", title="decode step vs context")
    axes.legend()


def _concurrency(axes: Any, result: dict[str, Any]) -> None:
    rows = result["rows"]
    sessions = [r["sessions"] for r in rows]
    medians, spread = _errorbars([r["aggregate_tok_s"] for r in rows])
    axes.errorbar(sessions, medians, yerr=spread, marker="o", capsize=3, label="aggregate")
    axes.plot(sessions, [medians[0] * s for s in sessions], ":", color="grey", label="linear")
    axes.set(
        xlabel="concurrent sessions",
        ylabel="aggregate decode tok/s",
        title="throughput under concurrency",
    )
    axes.legend()


def _mixed(axes: Any, result: dict[str, Any]) -> None:
    names = ["isolate", "fifo"]
    ratios = [result[f"itl_ratio_{n}"] for n in names]
    axes.bar(names, ratios, color=["tab:green", "tab:red"])
    axes.axhline(1.0, color="grey", linestyle=":")
    axes.set(ylabel="interactive ITL p50 ÷ alone", title="chat turn beside a background job")


def _memory(axes: Any, result: dict[str, Any]) -> None:
    names = list(result["layouts"])
    planned = [result["layouts"][n]["planned_bytes"] / 2**20 for n in names]
    measured = [result["layouts"][n]["measured_pool_bytes"] / 2**20 for n in names]
    positions = range(len(names))
    axes.bar([p - 0.2 for p in positions], planned, 0.4, label="planned")
    axes.bar([p + 0.2 for p in positions], measured, 0.4, label="measured")
    axes.set_xticks(list(positions), names, fontsize=8)
    axes.set(ylabel="KV pool (MiB)", title="KV pool at max_seqs=4, context 2048")
    axes.legend()
