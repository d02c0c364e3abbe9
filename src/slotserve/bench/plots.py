"""PNG plots of bench results (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Callable
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
    drawing = DRAWINGS.get(scenario)
    if drawing is None:
        return False
    draw, panels = drawing
    plt = _pyplot()
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.6), dpi=110, squeeze=False)
    draw(list(axes[0]), result)
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


def _single(panels: list[Any], result: dict[str, Any]) -> None:
    axes = panels[0]
    rows = result["rows"]
    lengths = [r["prompt_tokens"] for r in rows]
    medians, spread = _errorbars([r["decode_tok_s"] for r in rows])
    label = f"slotserve ({result.get('halves', 'eager')} halves)"
    axes.errorbar(lengths, medians, yerr=spread, marker="o", capsize=3, label=label)
    if all("decode_tok_s_int8" in r for r in rows):  # dense weights only
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


def _layouts(panels: list[Any], result: dict[str, Any]) -> None:
    axes = panels[0]
    for name, points in result["layouts"].items():
        contexts = [p["context"] for p in points]
        medians, spread = _errorbars([p["step_ms"] for p in points])
        axes.errorbar(contexts, medians, yerr=spread, marker="o", capsize=3, label=name)
    axes.set(xlabel="context (tokens)", ylabel="decode step (ms)", title="decode step vs context")
    axes.legend()


def _concurrency(panels: list[Any], result: dict[str, Any]) -> None:
    axes = panels[0]
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


def _mixed(panels: list[Any], result: dict[str, Any]) -> None:
    """Left: isolate vs fifo; right: the background-share sweep (when the run has one)."""
    axes = panels[0]
    names = ["isolate", "fifo"]
    ratios = [result[f"itl_ratio_{n}"] for n in names]
    axes.bar(names, ratios, color=["tab:green", "tab:red"])
    axes.axhline(1.0, color="grey", linestyle=":")
    axes.set(ylabel="interactive ITL p50 ÷ alone", title="chat turn beside a background job")
    _share_sweep(panels[1], result.get("share_sweep", []))


def _share_sweep(axes: Any, sweep: list[dict[str, Any]]) -> None:
    if not sweep:
        axes.set_axis_off()
        return
    shares = [p["background_min_share"] for p in sweep]
    for stat, style in (("p50", "o-"), ("mean", "s--"), ("p90", "^:")):
        axes.plot(shares, [p[f"ratio_{stat}"] for p in sweep], style, label=f"ITL {stat}")
    axes.axhline(1.0, color="grey", linestyle=":")
    axes.set(
        xlabel="background minimum share (isolate)",
        ylabel="chat ITL ÷ alone",
        title="background share vs chat ITL",
    )
    tokens = axes.twinx()
    tokens.bar(
        shares,
        [p["background_tokens_during_turn"] for p in sweep],
        width=0.015,
        alpha=0.3,
        color="tab:grey",
        label="background tokens",
    )
    tokens.set_ylabel("background tokens during the turn")
    lines, labels = axes.get_legend_handles_labels()
    bars, bar_labels = tokens.get_legend_handles_labels()
    axes.legend(lines + bars, labels + bar_labels, fontsize=8, loc="upper left")


def _structured(panels: list[Any], result: dict[str, Any]) -> None:
    axes = panels[0]
    rows = result["rows"]
    positions = range(len(rows))
    for offset, key, label in (
        (-0.2, "step_ms_free", "free"),
        (0.2, "step_ms_constrained", "JSON schema"),
    ):
        medians, spread = _errorbars([r[key] for r in rows])
        axes.bar([p + offset for p in positions], medians, 0.4, yerr=spread, capsize=3, label=label)
    for p, row in zip(positions, rows, strict=True):
        top = row["step_ms_constrained"]["max"]
        axes.annotate(
            f"×{row['step_ratio']['median']:.2f}", (p + 0.2, top), ha="center", va="bottom"
        )
    axes.set_ylim(0, 1.15 * max(r["step_ms_constrained"]["max"] for r in rows))
    axes.set_xticks(list(positions), [f"batch {r['batch']}" for r in rows])
    axes.set(ylabel="decode step (ms)", title="constrained vs free decoding (median, min–max)")
    axes.legend()


def _memory(panels: list[Any], result: dict[str, Any]) -> None:
    axes = panels[0]
    names = list(result["layouts"])
    planned = [result["layouts"][n]["planned_bytes"] / 2**20 for n in names]
    measured = [result["layouts"][n]["measured_pool_bytes"] / 2**20 for n in names]
    positions = range(len(names))
    axes.bar([p - 0.2 for p in positions], planned, 0.4, label="planned")
    axes.bar([p + 0.2 for p in positions], measured, 0.4, label="measured")
    axes.set_xticks(list(positions), names, fontsize=8)
    axes.set(ylabel="KV pool (MiB)", title="KV pool at max_seqs=4, context 2048")
    axes.legend()


# Each scenario's drawing and how many panels (side by side) it draws on.
DRAWINGS: dict[str, tuple[Callable[[list[Any], dict[str, Any]], None], int]] = {
    "single": (_single, 1),
    "layouts": (_layouts, 1),
    "concurrency": (_concurrency, 1),
    "mixed": (_mixed, 2),
    "structured": (_structured, 1),
    "memory": (_memory, 1),
}
