"""Markdown report: machine, versions, the exact command, and one section per scenario."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any

from slotserve.bench.executors import executors_section
from slotserve.bench.models import models_section
from slotserve.bench.prefix_store import store_section
from slotserve.bench.servers import servers_section
from slotserve.bench.speculative import speculative_section
from slotserve.bench.stats import format_summary, markdown_table
from slotserve.bench.structured_hostile import hostile_section
from slotserve.bench.structured_tools import tool_calls_section
from slotserve.memory import format_bytes


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [
                line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")
            ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, "
        f"slotserve {version('slotserve')}"
    )


def _single(r: dict[str, Any]) -> list[str]:
    halves = r.get("halves", "eager")
    lines = [
        f"## single: one stream, bundled model in process ({halves} halves)",
        "",
        f"Greedy; decode rate over {r['decode_tokens']} tokens after the prompt; "
        f"{r['repeats']} repeats after one warm-up; torch's own ops on "
        f"{r.get('torch_threads', '?')} thread(s), as `slotserve.load` left them. The int8 "
        "column (`--weights fp32` runs only) is the same model with int8 projections.",
        "",
    ]
    rows = [
        [
            str(x["prompt_tokens"]),
            format_summary(x["prefill_tok_s"]),
            format_summary(x["decode_tok_s"]),
            format_summary(x["decode_tok_s_int8"]) if "decode_tok_s_int8" in x else "—",
        ]
        for x in r["rows"]
    ]
    header = ["prompt tokens", "prefill tok/s", "decode tok/s", "decode tok/s, int8 weights"]
    lines += markdown_table(header, rows)
    for name, baseline in r.get("baselines", {}).items():
        if "skipped" in baseline:
            lines += [f"Baseline {name}: skipped ({baseline['skipped']}).", ""]
        else:
            cells = ", ".join(
                f"{x['prompt_tokens']}: {x['decode_tok_s']:.1f}" for x in baseline["rows"]
            )
            lines += [f"Baseline {name}, decode tok/s by prompt length (same run): {cells}.", ""]
    return lines


def _layouts(r: dict[str, Any]) -> list[str]:
    rows = r["layouts"]
    contexts = [p["context"] for p in next(iter(rows.values()))]
    lines = [
        "## layouts: decode step time (ms) vs context, one session",
        "",
        f"Median (min–max) over {r['steps_per_point']} decode steps at each length. The "
        "ring keeps its last 1024 positions, so past that its attention is windowed.",
        "",
    ]
    body = [
        [name] + [format_summary(p["step_ms"]) for p in points] for name, points in rows.items()
    ]
    return lines + markdown_table(["layout"] + [f"context {c}" for c in contexts], body)


def _concurrency(r: dict[str, Any]) -> list[str]:
    lines = [
        "## concurrency: aggregate decode throughput and per-request ITL",
        "",
        f"Sessions decode {r['decode_tokens']} tokens each, all submitted together; "
        f"{r['repeats']} repeats. Scaling 8 vs 1: **{r['scaling_8_vs_1']}×**.",
        "",
    ]
    rows = [
        [
            str(x["sessions"]),
            format_summary(x["aggregate_tok_s"]),
            f"{x['itl_p50_s'] * 1000:.0f}",
            f"{x['itl_p99_s'] * 1000:.0f}",
        ]
        for x in r["rows"]
    ]
    return lines + markdown_table(["sessions", "aggregate tok/s", "ITL p50 ms", "ITL p99 ms"], rows)


def _mixed(r: dict[str, Any]) -> list[str]:
    lines = [
        "## mixed: an interactive chat turn beside a long background job",
        "",
        "ITL p50 of the chat turn with a 1024-token background job in flight, divided by "
        "its ITL p50 alone (same run).",
        "",
    ]
    rows = [
        [
            policy,
            f"{r[policy]['itl_p50_alone_s'] * 1000:.0f}",
            f"{r[policy]['itl_p50_with_background_s'] * 1000:.0f}",
            f"**{r[policy]['ratio']}**",
        ]
        for policy in ("isolate", "fifo")
    ]
    lines += markdown_table(["policy", "alone ms", "with background ms", "ratio"], rows)
    return lines + _share_sweep(r.get("share_sweep", []), r["isolate"]["background_min_share"])


def _share_sweep(sweep: list[dict[str, Any]], default: float) -> list[str]:
    """The background minimum shares swept under ``isolate``, one row each."""
    if not sweep:
        return []
    lines = [
        "### mixed: background share vs the chat turn's ITL",
        "",
        "Under `isolate`, the background job's minimum share of contended steps "
        "(`background_min_share`) against the chat turn's ITL: each ratio is the turn's "
        "figure beside the job divided by its figure alone (back to back, median over "
        "repeats); background tokens are those the job produced while the turn ran.",
        "",
    ]
    rows = [
        [
            f"{point['background_min_share']:g}"
            + (" (default)" if point["background_min_share"] == default else ""),
            f"{point['ratio_p50']:.2f}",
            f"{point['ratio_mean']:.2f}",
            f"{point['ratio_p90']:.2f}",
            str(point["background_tokens_during_turn"]),
        ]
        for point in sweep
    ]
    header = [
        "background share",
        "ITL p50 ratio",
        "ITL mean ratio",
        "ITL p90 ratio",
        "background tokens during the turn",
    ]
    return lines + markdown_table(header, rows)


def _bargein(r: dict[str, Any]) -> list[str]:
    lines = [
        "## bargein: short sessions cancelled at random points",
        "",
        f"{r['sessions']} sessions at {r['sessions_per_s']}/s, each cancelled after 1–11 tokens.",
        "",
    ]
    rows = [
        [
            f"{r['cancel_release_p50_s'] * 1000:.1f}",
            f"{r['cancel_release_p99_s'] * 1000:.1f}",
            f"{r['cancel_release_max_s'] * 1000:.1f}",
            f"{r['step_p99_s'] * 1000:.1f}",
            str(r["slots_in_use_end"]),
            str(r["kv_blocks_leaked"]),
        ]
    ]
    header = [
        "cancel→release p50 ms",
        "p99 ms",
        "max ms",
        "step p99 ms",
        "slots in use at end",
        "KV blocks leaked",
    ]
    return lines + markdown_table(header, rows)


def _structured(r: dict[str, Any]) -> list[str]:
    lines = [
        "## structured: constrained decoding (JSON schema) vs free, per decode step",
        "",
        f"Each request decodes {r['decode_tokens']} tokens with the server's default "
        "sampling; constrained requests follow a JSON schema (an array of records, "
        "llguidance) that cannot end sooner. Step time is the median gap between tokens "
        "while every request of the batch decodes; the ratio is constrained ÷ free, the "
        f"pair run back to back, over {r['repeats']} repeats. Compiling the schema took "
        f"{r['grammar_first_compile_s'] * 1000:.0f} ms the first time (with the "
        f"tokenizer's index), {r['grammar_compile_s'] * 1000:.1f} ms after.",
        "",
    ]
    rows = [
        [
            str(x["batch"]),
            format_summary(x["step_ms_free"]),
            format_summary(x["step_ms_constrained"]),
            f"**{format_summary(x['step_ratio'], 2)}**",
            format_summary(x["grammar_ms_per_step"], 2),
            format_summary(x["sampling_ms_per_token_free"], 2),
            format_summary(x["sampling_ms_per_token_constrained"], 2),
        ]
        for x in r["rows"]
    ]
    header = [
        "batch",
        "free step ms",
        "constrained step ms",
        "ratio",
        "grammar ms per step",
        "sampling ms/token, free",
        "sampling ms/token, constrained",
    ]
    lines += markdown_table(header, rows)
    lines += _itl_while_compiling(r["itl_while_compiling"]) if "itl_while_compiling" in r else []
    lines += hostile_section(r["hostile_schemas"]) if "hostile_schemas" in r else []
    return lines + (tool_calls_section(r["tool_calls"]) if "tool_calls" in r else [])


def _itl_while_compiling(w: dict[str, Any]) -> list[str]:
    """Issue 30's target: an interactive request's ITL while a schema compiles."""
    met = "met" if w["itl_ratio_pool_over_target"] == 0 else "missed"
    return [
        "",
        f"An interactive greedy request's ITL ({w['itl_tokens']} tokens, engine alone) "
        f"while a schema of {w['slow_schema_patterns']['pool']} patterns compiles in the "
        f"bounded pool: {format_summary(w['itl_ms_compiling_pool'], 2)} ms against "
        f"{format_summary(w['itl_ms_alone'], 2)} ms alone, **"
        f"{format_summary(w['itl_ratio_pool'], 2)}×** (target ≤ {w['itl_target_ratio']}×: "
        f"{met}; the compile still ran at the request's end in "
        f"{w['overlap_pool']:.0%} of repeats). Compiled the old way, in a thread of the "
        f"serving process ({w['slow_schema_patterns']['thread']} patterns): "
        f"{format_summary(w['itl_ms_compiling_thread'], 2)} ms, "
        f"{format_summary(w['itl_ratio_thread'], 2)}× (still running in "
        f"{w['overlap_thread']:.0%}).",
        "",
    ]


def _prefix(r: dict[str, Any]) -> list[str]:
    on, off = r["on"], r["off"]
    lines = [
        "## prefix: a shared system prompt, and a multi-turn chat, cache off vs on",
        "",
        f"The same {r['system_tokens']}-token system prompt with {r['questions']} different "
        f"short questions, one after another ({r['new_tokens']} tokens each, greedy), on a "
        "fresh one-slot cell engine without and then with the prefix cache, back to back "
        f"in each of {r['repeats']} repeats. With the cache the first question computes the "
        "system prompt and publishes it; the others restore it. Prefill throughput counts "
        "computed tokens only, over a span that includes the restoration.",
        "",
    ]
    rows = [
        [
            "off",
            format_summary({k: v * 1000 for k, v in r["ttft_p50_s_off"].items()}),
            str(off["prompt_tokens_computed"]),
            str(off["prompt_tokens_restored"]),
            format_summary(r["prefill_tok_s_off"]),
        ],
        [
            "on",
            format_summary({k: v * 1000 for k, v in r["ttft_p50_s_on"].items()}),
            str(on["prompt_tokens_computed"]),
            str(on["prompt_tokens_restored"]),
            format_summary(r["prefill_tok_s_on"]),
        ],
    ]
    header = [
        "cache",
        "TTFT p50 ms",
        "prompt tokens computed",
        "restored",
        "prefill tok/s (computed)",
    ]
    lines += markdown_table(header, rows)
    lines += [f"TTFT p50 ratio off ÷ on: **{format_summary(r['ttft_ratio'], 2)}×**.", ""]
    chat = r["chat"]
    lines += [
        f"Multi-turn chat through `TextLLMRunner` ({len(chat['on'])} turns after the "
        f"system prompt, {r['chat_new_tokens']} tokens a reply): prompt tokens each turn "
        "computed.",
        "",
    ]
    chat_rows = [
        [
            str(i + 1),
            str(a["conversation_tokens"]),
            str(b["prompt_tokens_computed"]),
            str(a["prompt_tokens_computed"]),
            str(a["prompt_tokens_restored"]),
            f"{b['ttft_s'] * 1000:.0f}",
            f"{a['ttft_s'] * 1000:.0f}",
        ]
        for i, (a, b) in enumerate(zip(chat["on"], chat["off"], strict=True))
    ]
    chat_header = [
        "turn",
        "conversation tokens",
        "computed, off",
        "computed, on",
        "restored, on",
        "TTFT ms, off",
        "TTFT ms, on",
    ]
    lines += markdown_table(chat_header, chat_rows)
    return lines + (store_section(r["store"]) if "store" in r else [])


def _memory(r: dict[str, Any]) -> list[str]:
    lines = [
        "## memory: a server's peak anonymous memory at its worst case against its plan, "
        "and the KV pool per layout",
        "",
    ]
    if "server" in r:
        lines += _memory_server(r["server"])
    if "side_by_side" in r:
        lines += _memory_side_by_side(r["side_by_side"])
    lines += [
        f"### memory: KV pool at max_seqs={r['max_seqs']}, max_context={r['max_context']}",
        "",
        f"Weights: {format_bytes(r['weights_bytes'])} (as loaded). Each pool is measured in a "
        "fresh process; RSS growth is measured after writing every page of the pool.",
        "",
    ]
    rows = [
        [
            name,
            format_bytes(x["planned_bytes"]),
            format_bytes(x["measured_pool_bytes"]),
            format_bytes(x["rss_growth_bytes"]),
            format_bytes(x["worst_case_bytes"]),
        ]
        for name, x in r["layouts"].items()
    ]
    header = ["layout", "planned KV", "measured pool", "RSS growth", "plan worst case"]
    return lines + markdown_table(header, rows)


def _memory_server(s: dict[str, Any]) -> list[str]:
    """The server half of ``memory`` (`slotserve.bench.worst_case`)."""
    plan = s["plan"]
    prefix = s["prefix"]
    cache = (
        "no prefix phase (the prefix cache is off)"
        if prefix.get("off")
        else f"distinct prompts until the prefix cache was full ({prefix['snapshots']} "
        f"snapshots pinning {format_bytes(prefix['bytes_pinned'])} of "
        f"{format_bytes(prefix['budget_bytes'])}, {prefix['evictions']} evictions)"
    )
    stored = s.get("responses") or {}
    responses = (
        f"stored responses until the store held {format_bytes(stored['held_bytes'])} of its "
        f"{format_bytes(stored['budget_bytes'])} ({stored['stored']} of at most "
        f"{stored['size']} responses)"
        if "held_bytes" in stored
        else f"no stored responses ({stored.get('left_empty', 'none sent')})"
    )
    total, peak = plan["worst_case_bytes"], s["peak_anonymous_bytes"]
    lines = [
        f"`slotserve serve --model {s['model']} {' '.join(s['flags'])}` "
        f"({plan['layout']}, {plan['kv_dtype']} KV), driven to its worst case. Serving: a "
        f"short chat turn and completion, {responses}, {cache}, then a worst-case round: "
        f"{plan['max_seqs']} streams at once, each a distinct prompt of "
        f"{plan['max_context'] - s['decode_tokens']} tokens and {s['decode_tokens']} tokens "
        "(`ignore_eos`), every session at max_context, the concurrent prefill in the largest "
        f"steps; beside it, from its start, {s['requests'].get('grammars', 0)} structured "
        "requests (a schema each: the first builds the grammar compiler's index while the "
        f"largest steps run). Then {s['rounds']} more round(s), the prefix cache full again "
        "and the grammars held. Anonymous bytes of the server process from `/proc/PID/status` "
        "(RssAnon), what the plan counts; a phase's peak is its resident peak (VmHWM, reset "
        "when the server is ready and before each phase) less the file pages resident when "
        "it began. The server's grammar worker processes are read apart (each its resident "
        "peak less its file pages) and added to the whole peak.",
        "",
        f"Peak anonymous **{format_bytes(peak)}** against the plan's total "
        f"{format_bytes(total)}: **{peak / total:.3f}×** (peak resident "
        f"{format_bytes(s['peak_rss_bytes'])}). The load's own resident peak, before "
        f"serving: {format_bytes(s['load_peak_rss_bytes'])}.",
        "",
    ]
    rows = [
        [
            row["span"],
            ", ".join(row["arenas"]) or "—",
            format_bytes(row["planned_bytes"]),
            format_bytes(row["measured_bytes"]),
        ]
        for row in s["arena_rows"]
    ]
    rows.append(
        ["the server and its workers, peak", "all", format_bytes(total), format_bytes(peak)]
    )
    header = ["span (resident set)", "plan arenas", "planned", "measured"]
    return lines + markdown_table(header, rows)


def _memory_side_by_side(r: dict[str, Any]) -> list[str]:
    """``memory --baselines``: both servers' whole resident set (`slotserve.bench.memory_side`)."""
    if "skipped" in r:
        return [f"### memory: beside llama-server: skipped ({r['skipped']})", ""]
    lines = [
        f"### memory: beside llama-server, {r['seqs']} slots × {r['context']} tokens",
        "",
        f"Both servers on `{r['gguf']}`, {r['threads']} threads, one at a time: "
        f"{r['seqs']} distinct prompts of {r['prompt_tokens']} tokens at once, "
        f"{r['decode_tokens']} greedy tokens each. slotserve: `serve --kv-layout cell` "
        "(fp16 KV, the prefix cache on); llama-server: its defaults (f16 KV, allocated at "
        f"start). Resident set (VmRSS) and anonymous bytes (RssAnon: what the plan budgets "
        "and a device's low-memory killer counts) at ready, right after the last answer and "
        f"after a {r['pause_s']:g} s pause; the peak is VmHWM over the process's life.",
        "",
    ]
    keys = (
        ("resident at ready", "ready_bytes"),
        ("resident right after the run", "after_bytes"),
        (f"resident after {r['pause_s']:g} s idle", "paused_bytes"),
        ("resident peak", "peak_bytes"),
        ("anonymous at ready", "ready_anonymous_bytes"),
        ("anonymous right after the run", "after_anonymous_bytes"),
        (f"anonymous after {r['pause_s']:g} s idle", "paused_anonymous_bytes"),
    )
    servers, ratios = r["servers"], r["ratios"]
    rows = [
        [
            label,
            format_bytes(servers["slotserve"][key]),
            format_bytes(servers["llama-server"][key]),
            f"{ratios[key]:.2f}×",
        ]
        for label, key in keys
    ]
    return lines + markdown_table(["memory", "slotserve", "llama-server", "ratio"], rows)


SECTIONS = {
    "single": _single,
    "layouts": _layouts,
    "concurrency": _concurrency,
    "mixed": _mixed,
    "bargein": _bargein,
    "structured": _structured,
    "prefix": _prefix,
    "memory": _memory,
    "executors": executors_section,
    "servers": servers_section,
    "speculative": speculative_section,
    "models": models_section,
}


def markdown_report(results: dict[str, Any], command: str, images: dict[str, str]) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {datetime.now(UTC):%Y-%m-%d}.",
        "",
        f"Machine: {machine_description()}.",
        "",
        "Figures are medians over repeats with min–max in brackets; ratios are measured "
        "in the same run. These machines are shared and noisy: compare within a table.",
        "",
    ]
    for name, result in results.items():
        lines += SECTIONS[name](result)
        if name in images:
            lines += [f"![{name}]({images[name]})", ""]
    return "\n".join(lines)


def replace_section(document: str, name: str, results: dict[str, Any], command: str) -> str:
    """``document`` with its ``## name`` section replaced by ``results[name]``'s (appended if
    it has none), with the command and machine it was measured with."""
    section = SECTIONS[name](results[name])
    section[1:1] = [
        "",
        f"Written by `{command}` on {datetime.now(UTC):%Y-%m-%d}, {machine_description()}.",
    ]
    lines = document.rstrip("\n").split("\n")
    span = _section_span(lines, name)
    if span is None:
        return "\n".join([*lines, "", *section]).rstrip("\n") + "\n"
    start, end = span
    return "\n".join([*lines[:start], *section, *lines[end:]]).rstrip("\n") + "\n"


def keep_sections(old: str, new: str, names: tuple[str, ...]) -> str:
    """``new`` with the sections of ``old`` that ``new`` lacks appended as they were: those
    of ``names`` (written by their own scenarios) and every hand-written one (a ``## ``
    heading no scenario writes: how to run, accuracy, history)."""
    old_lines = old.rstrip("\n").split("\n")
    lines = new.rstrip("\n").split("\n")
    for heading in [line for line in old_lines if line.startswith("## ")]:
        name = heading[3:].split(":")[0].strip()
        kept = name in names or name not in SECTIONS
        span = _section_span(old_lines, name)
        if kept and span is not None and _section_span(lines, name) is None:
            lines += ["", *old_lines[span[0] : span[1]]]
    return "\n".join(lines) + "\n"


def _section_span(lines: list[str], name: str) -> tuple[int, int] | None:
    """Where the ``## name`` (or ``## name: …``) section starts and ends (the next ``## ``)
    in ``lines``."""
    start = next(
        (
            i
            for i, line in enumerate(lines)
            if line == f"## {name}" or line.startswith(f"## {name}:")
        ),
        None,
    )
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start, end
