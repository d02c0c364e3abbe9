"""``bench prefix``, its disk-tier variant: the prefix store on and off, in one run.

Restart TTFT. A conversation of 4 turns after a ~1,000-token system prompt (what fits a
small model's context) on a one-slot cell engine with the prefix cache and the store; its
files flushed, the store directory is copied aside, and the same engine answers turn 5 (a
process that never restarted: memory restores the history). Then the restart, engine-level:
a fresh engine on the copied store answers turn 5 (it restores the history from disk), and
a fresh engine without a store answers it cold (it computes the whole history). Both fresh
engines take turns going first across repeats. Reported: TTFT of each, the cold ÷ restored
ratio per repeat, the tokens each restored, and the disk read's own time (inside the
prefill span, ``restore_time``). The same at the server (`slotserve.bench.prefix_restart`):
a real ``serve`` killed with SIGKILL and started again on its store, against a cold one.

Writes under load. A storm of distinct one-turn conversations, one after another beside a
long decode stream, on a two-slot engine with the cache on and the store on (a disk budget
of a few snapshots, so files are evicted) and off, taking turns across repeats. Every turn
is kept for a next one, so the store writes each on its own thread. Reported: step time
p50/p99 over every step, the stream's ITL p50/p99, and the store's files, bytes against the
budget, writes and skips: what the writer costs a step.

What a chat workload writes. `CHAT_CONVERSATIONS` conversations of `CHAT_TURNS` turns after
one system prompt, interleaved, on a two-slot engine whose memory tier holds about one
conversation, with the store writing every published snapshot (``prefix_store_writes=
"all"``, no minimum, no rate limit: the policy before the disk tier learnt to spend its
writes) and with the defaults (turns and hit prompts, at least
`DEFAULT_PREFIX_STORE_MIN_TOKENS` tokens, at most `DEFAULT_PREFIX_STORE_WRITE_RATE` a
second). Then a restart: a fresh engine on the files answers each conversation's next turn.
Reported, each side: files and bytes written, per turn and per second of the workload,
and bytes written per token the restart restored from them: what the writes bought.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from slotserve.bench.prefix_restart import run_restart_server
from slotserve.bench.stats import format_summary, markdown_table, percentile, summary
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.engine.config import (
    DEFAULT_PREFIX_STORE_MIN_TOKENS,
    DEFAULT_PREFIX_STORE_WRITE_RATE,
)
from slotserve.memory import format_bytes
from slotserve.model import Model
from slotserve.sampling import SamplingParams

BLOCK_SIZE = 16
HISTORY_TURNS = 4
TURN_TOKENS = 12  # the user's part of each turn
REPLY_TOKENS = 16
STORM_PROMPTS = 12
STORM_FILES = 4  # the storm's disk budget, in snapshots
STREAM_PROMPT = 16
SERVER_MIN_CONTEXT = 512
CHAT_CONVERSATIONS = 6
CHAT_TURNS = 4
# The policy before: every published snapshot written, whatever its length, at any rate.
WRITE_EVERYTHING = {
    "prefix_store_writes": "all", "prefix_store_min_tokens": 1,
    "prefix_store_write_rate": 1 << 40,
}  # fmt: skip


def _config(
    model: Model, max_seqs: int, context: int, store: Path | None, **extra: Any
) -> EngineConfig:
    config = EngineConfig(
        max_seqs=max_seqs, max_context=context, kv_layout="cell", block_size=BLOCK_SIZE
    )
    pool_bytes = config.kv_bytes(model.info)
    return dataclasses.replace(config, prefix_cache_bytes=pool_bytes, prefix_store=store, **extra)


def _whole_blocks(model: Model, tokens: int) -> int:
    """A cell-layout context of whole blocks that holds ``tokens``, within the model's."""
    context = min(model.info.max_context, -(-tokens // BLOCK_SIZE) * BLOCK_SIZE)
    return context // BLOCK_SIZE * BLOCK_SIZE


def _tokens(model: Model, n: int, salt: int) -> list[int]:
    """``n`` ordinary token ids, distinct for each ``salt``."""
    vocab = model.info.vocab_size
    low = min(100, vocab // 4)
    return [low + (salt * 7919 + i * 104_729) % (vocab - low) for i in range(n)]


# -- restart TTFT --------------------------------------------------------------------


def _converse(engine: Engine, system: list[int], turns: list[list[int]]) -> list[int]:
    """The conversation's history after ``turns``, each turn kept in the cache."""
    params = SamplingParams(temperature=0, max_new_tokens=REPLY_TOKENS, ignore_eos=True)
    history = list(system)
    for user in turns:
        final = engine.submit([*history, *user], params, publish_completion=True).result()
        history = [*history, *user, *final.tokens]
    return history


def _turn(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_new_tokens=REPLY_TOKENS, ignore_eos=True)
    final: Finished = engine.submit(prompt, params).result()
    timings = final.timings
    assert timings.ttft is not None
    return {
        "ttft_s": timings.ttft,
        "restored": timings.prompt_tokens_restored,
        "computed": timings.prompt_tokens_computed,
        "restore_time_s": timings.restore_time,
    }


def _restart_repeat(
    model: Model, system: list[int], turns: list[list[int]], context: int, first_cold: bool
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-store-") as where:
        live, copy = Path(where) / "live", Path(where) / "restart"
        engine = Engine(model, _config(model, 1, context, live))
        try:
            history = _converse(engine, system, turns[:HISTORY_TURNS])
            assert engine.prefix is not None and engine.prefix.store is not None
            engine.prefix.store.flush()
            shutil.copytree(live, copy)  # the files a kill -9 now would leave
            turn5 = [*history, *turns[HISTORY_TURNS]]
            never = _turn(engine, turn5)
        finally:
            engine.close()
        sides: dict[str, dict[str, Any]] = {}
        for side in ("cold", "restored") if first_cold else ("restored", "cold"):
            store = copy if side == "restored" else None
            fresh = Engine(model, _config(model, 1, context, store))
            try:
                sides[side] = _turn(fresh, turn5)
                stats = fresh.stats().prefix
                if side == "restored":
                    assert stats is not None and stats.store is not None
                    sides[side]["store_files"] = stats.store.files
                    sides[side]["store_bytes"] = stats.store.bytes
            finally:
                fresh.close()
    return {"history_tokens": len(history), "never_restarted": never, **sides}


def run_restart(model: Model, system: list[int], repeats: int) -> dict[str, Any]:
    """Turn 5 after a restart, with the store and without, beside a never-restarted engine."""
    turns = [_tokens(model, TURN_TOKENS, 1000 + i) for i in range(HISTORY_TURNS + 1)]
    context = _whole_blocks(
        model, len(system) + (HISTORY_TURNS + 1) * (TURN_TOKENS + REPLY_TOKENS) + REPLY_TOKENS
    )
    _restart_repeat(model, system[: len(system) // 4], turns, context, True)  # warm-up
    runs = [_restart_repeat(model, system, turns, context, i % 2 == 0) for i in range(repeats)]
    last = runs[-1]
    return {
        "history_tokens": last["history_tokens"],
        "context": context,
        "ttft_s_never_restarted": summary([r["never_restarted"]["ttft_s"] for r in runs]),
        "ttft_s_restored": summary([r["restored"]["ttft_s"] for r in runs]),
        "ttft_s_cold": summary([r["cold"]["ttft_s"] for r in runs]),
        "ratio_cold_over_restored": summary(
            [r["cold"]["ttft_s"] / r["restored"]["ttft_s"] for r in runs]
        ),
        "read_s": summary([r["restored"]["restore_time_s"] for r in runs]),
        "restored_tokens": last["restored"]["restored"],
        "never_restarted_tokens": last["never_restarted"]["restored"],
        "cold_computed": last["cold"]["computed"],
        "store_files": last["restored"]["store_files"],
        "store_bytes": last["restored"]["store_bytes"],
    }


# -- writes under load ---------------------------------------------------------------


def _storm_side(
    model: Model, prompt_tokens: int, context: int, store: Path | None
) -> dict[str, Any]:
    snapshot = _config(model, 1, context, None).kv_bytes(model.info)
    budget = STORM_FILES * snapshot * prompt_tokens // context
    extra: dict[str, Any] = {}
    if store is not None:  # every turn written: what the writer costs a step
        extra = {"prefix_store_bytes": max(budget, 1), "prefix_store_min_tokens": 1}
    engine = Engine(model, _config(model, 2, context, store, **extra))
    try:
        decode = SamplingParams(
            temperature=0, max_new_tokens=context - STREAM_PROMPT, ignore_eos=True
        )
        stream = engine.submit(_tokens(model, STREAM_PROMPT, 1), decode)
        one = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
        for i in range(STORM_PROMPTS):
            prompt = _tokens(model, prompt_tokens, 10 + i)
            engine.submit(prompt, one, queue=True, publish_completion=True).result()
        stream.cancel(wait=True)
        itl = stream.result().timings.itl
        steps = list(engine.counters.step_seconds)
        figures: dict[str, Any] = {
            "step_p50_s": percentile(steps, 50),
            "step_p99_s": percentile(steps, 99),
            "itl_p50_s": percentile(itl, 50),
            "itl_p99_s": percentile(itl, 99),
            "steps": len(steps),
        }
        if store is not None:
            assert engine.prefix is not None and engine.prefix.store is not None
            engine.prefix.store.flush()
            report = engine.prefix.store.report()
            figures["store"] = {
                "budget_bytes": report.budget_bytes,
                "bytes": report.bytes,
                "files": report.files,
                "written": report.counters.written,
                "evictions": report.counters.evictions,
                "skipped": dict(report.counters.skipped),
            }
    finally:
        engine.close()
    return figures


def run_storm(model: Model, prompt_tokens: int, repeats: int) -> dict[str, Any]:
    """Step times and a decode stream's ITL while distinct prompts' snapshots are written
    (store on) or not (store off)."""
    want = max(prompt_tokens + 1, STREAM_PROMPT + 64 * STORM_PROMPTS // 4)
    context = min(model.info.max_context, -(-want // BLOCK_SIZE) * BLOCK_SIZE)
    context = context // BLOCK_SIZE * BLOCK_SIZE
    sides: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-storm-") as where:
        for i in range(repeats):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                store = Path(where) / f"{i}" if side == "on" else None
                sides[side].append(_storm_side(model, prompt_tokens, context, store))
    result: dict[str, Any] = {"prompts": STORM_PROMPTS, "prompt_tokens": prompt_tokens}
    for side, runs in sides.items():
        result[side] = {
            key: summary([r[key] for r in runs])
            for key in ("step_p50_s", "step_p99_s", "itl_p50_s", "itl_p99_s")
        }
    result["store"] = sides["on"][-1]["store"]
    return result


# -- what a chat workload writes -----------------------------------------------------


def _chat_writes_side(
    model: Model, system: list[int], where: Path, policy: dict[str, Any]
) -> dict[str, Any]:
    """`CHAT_CONVERSATIONS` conversations interleaved turn by turn, then a restart that
    answers each one's next turn from the files."""
    users = [
        [_tokens(model, TURN_TOKENS, 2000 + 100 * c + t) for t in range(CHAT_TURNS + 1)]
        for c in range(CHAT_CONVERSATIONS)
    ]
    want = len(system) + (CHAT_TURNS + 1) * (TURN_TOKENS + REPLY_TOKENS) + REPLY_TOKENS
    context = _whole_blocks(model, want)
    config = _config(model, 2, context, where, **policy)
    one_conversation = config.kv_bytes(model.info) // 2
    config = dataclasses.replace(config, prefix_cache_bytes=one_conversation)
    params = SamplingParams(temperature=0, max_new_tokens=REPLY_TOKENS, ignore_eos=True)
    histories = [list(system) for _ in range(CHAT_CONVERSATIONS)]
    engine = Engine(model, config)
    try:
        began = time.perf_counter()
        for turn in range(CHAT_TURNS):
            for c, history in enumerate(histories):
                prompt = [*history, *users[c][turn]]
                final = engine.submit(prompt, params, publish_completion=True).result()
                histories[c] = [*prompt, *final.tokens]
        assert engine.prefix is not None and engine.prefix.store is not None
        engine.prefix.store.flush()
        seconds = time.perf_counter() - began
        report = engine.prefix.store.report()
    finally:
        engine.close()
    fresh = Engine(model, config)
    try:
        restored = sum(
            _turn(fresh, [*history, *users[c][CHAT_TURNS]])["restored"]
            for c, history in enumerate(histories)
        )
    finally:
        fresh.close()
    turns = CHAT_CONVERSATIONS * CHAT_TURNS
    counters = report.counters
    return {
        "turns": turns,
        "seconds": seconds,
        "written": counters.written,
        "bytes_written": counters.bytes_written,
        "skipped": dict(counters.skipped),
        "files_per_turn": counters.written / turns,
        "bytes_per_s": counters.bytes_written / seconds,
        "restored_after_restart": restored,
        "bytes_per_restored_token": counters.bytes_written / restored if restored else None,
    }


def run_chat_writes(model: Model, system: list[int]) -> dict[str, Any]:
    """What a chat workload writes with every snapshot written (before) and with the
    defaults (after), in one run, each on a store of its own."""
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-writes-") as where:
        return {
            "conversations": CHAT_CONVERSATIONS,
            "turns": CHAT_TURNS,
            "before": _chat_writes_side(model, system, Path(where) / "all", WRITE_EVERYTHING),
            "after": _chat_writes_side(model, system, Path(where) / "reused", {}),
        }


def run_prefix_store(
    model: Model, system: list[int], repeats: int, warm_up: bool = True
) -> dict[str, Any]:
    """The four parts: `run_restart`, the server's (`run_restart_server`), `run_storm`,
    `run_chat_writes`."""
    # The server's chat: the system prompt and 5 turns of a short question (up to 40 tokens
    # where a token is a byte), a reply and the template's own tokens, in whole blocks.
    context = _whole_blocks(model, len(system) + (HISTORY_TURNS + 1) * 96 + 64)
    system_text = model.tokenizer.decode(system)
    cache_bytes = int(_config(model, 1, context, None).prefix_cache_bytes)
    server: dict[str, Any] = {
        "skipped": f"the model's context ({model.info.max_context} tokens) is under the "
        f"{SERVER_MIN_CONTEXT} the server's chat of {HISTORY_TURNS + 1} turns takes"
    }
    if model.info.max_context >= SERVER_MIN_CONTEXT:
        server = run_restart_server(
            model.source, system_text, context, cache_bytes, repeats, warm_up=warm_up
        )
    return {
        "restart": run_restart(model, system, repeats),
        "restart_server": server,
        "storm": run_storm(model, max(len(system) // 8, 8), repeats),
        "writes": run_chat_writes(model, system),
        "repeats": repeats,
    }


# -- report --------------------------------------------------------------------------


def _ms(cell: dict[str, float]) -> str:
    return format_summary({k: v * 1000 for k, v in cell.items()})


def store_section(r: dict[str, Any]) -> list[str]:
    """The markdown of `run_prefix_store`'s figures (a part of the prefix section)."""
    restart = r["restart"]
    lines = [
        "### prefix: the disk tier (`--prefix-store`), on and off",
        "",
        f"Restart TTFT. A conversation of {HISTORY_TURNS} turns ({restart['history_tokens']} "
        "tokens of history) on a one-slot cell engine with the cache and the store; then "
        "turn 5 on that engine (never restarted), on a fresh engine over the store's files "
        "(restored from disk), and on a fresh engine without a store (cold), in each of "
        f"{r['repeats']} repeats. Engine-level: a restart is a new engine in the same "
        "process, over the files a `kill -9` would have left.",
        "",
    ]
    rows = [
        ["never restarted (memory)", _ms(restart["ttft_s_never_restarted"]),
         str(restart["never_restarted_tokens"])],
        ["restarted, store on", _ms(restart["ttft_s_restored"]), str(restart["restored_tokens"])],
        ["restarted, store off (cold)", _ms(restart["ttft_s_cold"]), "0"],
    ]  # fmt: skip
    lines += markdown_table(["turn 5", "TTFT ms", "tokens restored"], rows)
    lines += [
        f"Cold ÷ restored TTFT: **{format_summary(restart['ratio_cold_over_restored'], 2)}×**; "
        f"the disk read itself {_ms(restart['read_s'])} ms "
        f"({restart['store_files']} files, {format_bytes(restart['store_bytes'])}).",
        "",
    ]
    return [
        *lines, *_server_lines(r["restart_server"], r["repeats"]), *_storm_lines(r["storm"]),
        *_writes_lines(r["writes"]),
    ]  # fmt: skip


def _server_lines(server: dict[str, Any], repeats: int) -> list[str]:
    if "skipped" in server:
        return [f"Restart TTFT, server-level: not run: {server['skipped']}.", ""]
    lines = [
        "Restart TTFT, server-level. `slotserve serve --prefix-store` on a one-slot cell "
        f"pool ({server['context']} tokens) holds {HISTORY_TURNS} chat turns after the same "
        "system prompt; it answers turn 5 (never restarted), is killed with SIGKILL, and a "
        "server started on the store's files (restored) and one without a store (cold) "
        "answer the same turn 5 as their first request, taking turns going first. TTFT is "
        "the client's, to the first streamed content chunk; the tokens restored are the "
        f"response's `cached_tokens` (fewest over the repeats); {repeats} repeats.",
        "",
    ]
    rows = [
        [label, _ms(server[f"ttft_s_{side}"]), str(server[f"cached_{side}"])]
        for label, side in (
            ("never restarted (memory)", "never_restarted"),
            ("killed, restarted, store on", "restored"),
            ("fresh server, no store (cold)", "cold"),
        )
    ]
    header = f"turn 5 ({server['history_tokens']} prompt tokens)"
    lines += markdown_table([header, "TTFT ms", "tokens restored"], rows)
    ratio = format_summary(server["ratio_cold_over_restored"], 2)
    return [*lines, f"Cold ÷ restored TTFT: **{ratio}×**.", ""]


def _storm_lines(storm: dict[str, Any]) -> list[str]:
    lines = [
        f"Writes under load. {storm['prompts']} distinct {storm['prompt_tokens']}-token "
        "prompts one after another beside a long decode stream on a two-slot engine, the "
        "store on (a budget of a few snapshots) and off: every prompt's snapshot is "
        "written by the store's thread.",
        "",
    ]
    rows = [
        [side, _ms(storm[side]["step_p50_s"]), _ms(storm[side]["step_p99_s"]),
         _ms(storm[side]["itl_p50_s"]), _ms(storm[side]["itl_p99_s"])]
        for side in ("off", "on")
    ]  # fmt: skip
    lines += markdown_table(
        ["store", "step p50 ms", "step p99 ms", "stream ITL p50 ms", "stream ITL p99 ms"], rows
    )
    store = storm["store"]
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(store["skipped"].items())) or "none"
    lines += [
        f"The store: {store['written']} files written, {store['evictions']} evicted, "
        f"{store['files']} kept, {format_bytes(store['bytes'])} of "
        f"{format_bytes(store['budget_bytes'])}; writes skipped: {skipped}.",
        "",
    ]
    return lines


def _writes_lines(writes: dict[str, Any]) -> list[str]:
    lines = [
        f"What a chat workload writes. {writes['conversations']} conversations of "
        f"{writes['turns']} turns after one system prompt, interleaved, on a two-slot engine "
        "whose memory tier holds about one conversation; then a restart answers each "
        "conversation's next turn from the files. Before: every published snapshot written "
        f'(`prefix_store_writes="all"`, no minimum, no rate limit); after: the defaults '
        f"(turns and hit prompts of at least {DEFAULT_PREFIX_STORE_MIN_TOKENS} tokens, at "
        f"most {DEFAULT_PREFIX_STORE_WRITE_RATE}/s).",
        "",
    ]
    rows = []
    for side in ("before", "after"):
        w = writes[side]
        per_token = w["bytes_per_restored_token"]
        rows.append([
            side, str(w["written"]), f"{w['files_per_turn']:.2f}",
            format_bytes(w["bytes_written"]), f"{format_bytes(int(w['bytes_per_s']))}/s",
            str(w["restored_after_restart"]),
            "-" if per_token is None else format_bytes(int(per_token)),
        ])  # fmt: skip
    header = ["writes", "files", "files a turn", "bytes", "rate", "restored after restart"]
    lines += markdown_table([*header, "bytes written a restored token"], rows)
    return lines
