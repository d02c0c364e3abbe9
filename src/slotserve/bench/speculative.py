"""Scenario ``speculative``: delivered tokens a second with n-gram speculation on and off.

Three workloads on two engines of the same config, one with ``speculate="ngram"`` and one
with ``"off"``, taking turns (on, off, on, off ...) so that the shared machine's load falls
on both alike:

- ``repetitive``: one stream, greedy; prompts whose answer repeats much of the prompt (a
  paragraph rewritten with one change, a text summarised with quotes, a JSON object repeated
  with one field changed);
- ``free-form``: one stream, greedy; chat questions whose answer the prompt does not hold
  (speculation must not cost there);
- ``repetitive x 8``: the repetitive prompts as 8 concurrent streams.

A stream's delivered rate is its tokens after the first over the time from its first token
to its last (only tokens the user gets, however many arrive together); a workload of several
streams reports their tokens over the wall time from the first token to the last. Each row
also gives the engine's drafted and accepted tokens. Both engines' outputs are compared, and
a difference is reported (it would be a bug: speculation changes nothing but speed).

With a ``draft`` model each workload runs a third time, on an engine of the same config
drafting with it (``speculate="draft"``), against the same engine without speculation.

Where llama-server is built (`slotserve.bench.llama_server`) and the model is a GGUF file,
the single-stream workloads also run on llama-server on the same file, once per n-gram
mode (``--spec-type`` none, ngram-simple, ngram-mod, ngram-cache), the same token ids
through its completions API, greedy, after slotserve's rounds (slotserve runs in process).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slotserve.bench.stats import summary
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.engine.probe import teacher_forced_logits
from slotserve.model import Model
from slotserve.model.layers import DenseLinear
from slotserve.sampling import SamplingParams

PARAGRAPH = (
    "The committee met on Tuesday to review the annual budget. After a long discussion it "
    "agreed to fund the new public library, to repair the old stone bridge over the river, "
    "and to hire two more teachers for the primary school. The mayor thanked everyone for "
    "their patience and asked the treasurer to publish the figures before the end of the month."
)
JSON_OBJECT = (
    '{"id": 4172, "name": "Ada Lovelace", "email": "ada@example.org", "city": "London", '
    '"languages": ["English", "French"], "active": true, "score": 97.5, '
    '"address": {"street": "12 St James Square", "postcode": "SW1Y 4JH"}}'
)
REPETITIVE = (
    f"Rewrite this paragraph exactly, changing only 'Tuesday' to 'Friday':\n\n{PARAGRAPH}",
    f"Summarise this text, quoting its sentences word for word:\n\n{PARAGRAPH}",
    f"Repeat this JSON object exactly, with the city changed to Paris:\n\n{JSON_OBJECT}",
)
FREE_FORM = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for learning a new language? Explain each briefly.",
    "Describe how a bicycle works to a child.",
)
MAX_NEW_TOKENS = 128
STREAMS = 8
LLAMA_SPEC_TYPES = ("none", "ngram-simple", "ngram-mod", "ngram-cache")


def run_speculative(model: Model, repeats: int = 1, draft: Model | None = None) -> dict[str, Any]:
    """Each workload ``repeats`` times on each engine, in turns (see the module docstring);
    with ``draft``, on an engine drafting with it too."""
    config = EngineConfig(
        max_seqs=STREAMS, max_context=1024, kv_layout="flat", max_batch_tokens=512
    )
    on = Engine(model, replace(config, speculate="ngram"))
    off = Engine(model, replace(config, speculate="off"))
    drafting = None
    if draft is not None:
        drafting = Engine(model, replace(config, speculate="draft"), draft=draft)
    try:
        prompts = {
            name: [model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
            for name, texts in (("repetitive", REPETITIVE), ("free-form", FREE_FORM))
        }
        workloads = {
            "repetitive": (prompts["repetitive"], 1),
            "free-form": (prompts["free-form"], 1),
            f"repetitive x {STREAMS}": (prompts["repetitive"], STREAMS),
        }
        rows = [
            _workload(name, on, off, batch, streams, repeats)
            for name, (batch, streams) in workloads.items()
        ]
        if drafting is not None:
            assert draft is not None
            for name, (batch, streams) in workloads.items():
                row = _workload(f"{name}, draft model", drafting, off, batch, streams, repeats)
                row["draft_agreement"] = _agreement(draft, off, batch)
                rows.append(row)
    finally:
        for engine in (on, off, drafting):
            if engine is not None:
                engine.close()
    single = {name: prompts for name, (prompts, streams) in workloads.items() if streams == 1}
    return {
        "max_new_tokens": MAX_NEW_TOKENS,
        "repeats": repeats,
        "rows": rows,
        "draft_model": None if draft is None else _described(draft),
        "llama_server": _llama_server_rows(model, single, repeats, draft),
    }


def _llama_server_rows(
    model: Model, workloads: dict[str, list[list[int]]], repeats: int, draft: Model | None
) -> dict[str, Any]:
    """Delivered tok/s of llama-server on ``model``'s GGUF (`_llama_file`), per
    ``--spec-type`` and workload, and with ``draft``'s file as ``--model-draft`` (or why
    it did not run)."""
    from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION, find_llama_server
    from slotserve.native import process_cores

    binary = find_llama_server()
    if binary is None:
        return {"skipped": "llama-server is not built; `make bench-deps` builds it"}
    target = _llama_file(model)
    if target is None:
        return {"skipped": f"llama-server needs a GGUF file of the weights slotserve runs; "
                f"{_described(model)} has none"}  # fmt: skip
    threads = process_cores()
    command = [str(binary), "-m", str(target), "-np", "1", "-c", "1024"]
    command += ["-t", str(threads), "-tb", str(threads), "--no-webui"]
    rows = {
        spec: _llama_rates([*command, "--spec-type", spec], workloads, repeats)
        for spec in LLAMA_SPEC_TYPES
    }
    result: dict[str, Any] = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "threads": threads,
        "file": target.name,
        "rows": rows,
    }
    if draft is not None:
        draft_file = _llama_file(draft)
        if draft_file is None:
            result["draft"] = {
                "skipped": f"no GGUF file of the draft's weights ({_described(draft)})"
            }
        else:
            # llama-server's own draft setting: its default draft length, greedy drafts.
            spec = ["--spec-type", "draft-simple", "--model-draft", str(draft_file)]
            spec += ["-td", str(threads), "-tbd", str(threads)]
            result["draft"] = {
                "file": draft_file.name,
                "rows": _llama_rates([*command, *spec], workloads, repeats),
            }
    return result


def _llama_file(model: Model) -> Path | None:
    """The GGUF file llama-server runs for ``model``: its own file where slotserve runs the
    file's blocks, the file dequantised to F32 where slotserve holds dense fp32 weights
    (the same values); None otherwise (not a GGUF file, or weights requantised to int8)."""
    from slotserve.bench.llama_server import make_f32_gguf

    if not model.source.endswith(".gguf"):
        return None
    if model.halves.kind == "block":
        return Path(model.source)
    weights = model.weights
    if weights is None:
        return None
    matrices = [
        m for layer in weights.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    if all(isinstance(m, DenseLinear) and m.weight.dtype == torch.float32 for m in matrices):
        return make_f32_gguf(Path(model.source))
    return None


def _llama_rates(
    command: list[str], workloads: dict[str, list[list[int]]], repeats: int
) -> dict[str, dict[str, float]]:
    """Start llama-server with ``command`` (less its address), then each workload's
    delivered tok/s (after a warm-up of its first prompt) over ``repeats`` of its prompts."""
    import openai

    from slotserve.bench.processes import ServerProcess, free_port

    port = free_port()
    server = ServerProcess([*command, "--host", "127.0.0.1", "--port", str(port)], port)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        name = server.model_name
        rates = {}
        for workload, prompts in workloads.items():
            _served_rate(client, name, prompts[0])  # warm-up
            rates[workload] = summary(
                [_served_rate(client, name, p) for _ in range(repeats) for p in prompts]
            )
        return rates
    finally:
        server.stop()


def _served_rate(client: Any, model_name: str, prompt: list[int]) -> float:
    """One greedy streamed completion of ``prompt``: delivered tokens a second (its tokens
    after the first over the time from the first chunk with text to the last)."""
    response = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=MAX_NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    times, tokens = [], 0
    for chunk in response:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    tokens = tokens or len(times)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return (tokens - 1) / span if span > 0 else 0.0


def _workload(
    name: str, on: Engine, off: Engine, prompts: list[list[int]], streams: int, repeats: int
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"on": [], "off": []}
    same = True
    before = on.stats().speculation
    for _ in range(repeats):
        for index in range(len(prompts) if streams == 1 else 1):
            line_up = [prompts[index]] if streams == 1 else _streams(prompts, streams)
            outputs = {}
            for label, engine in (("on", on), ("off", off)):
                rate, outputs[label] = _delivered_rate(engine, line_up)
                rates[label].append(rate)
            same = same and outputs["on"] == outputs["off"]
    after = on.stats().speculation
    assert before is not None and after is not None, f"the {name!r} engine does not speculate"
    drafted, accepted = after.drafted - before.drafted, after.accepted - before.accepted
    ratio = [a / b for a, b in zip(rates["on"], rates["off"], strict=True) if b > 0]
    return {
        "workload": name,
        "streams": streams,
        "tok_s_on": summary(rates["on"]),
        "tok_s_off": summary(rates["off"]),
        "speedup": summary(ratio),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "same_output": same,
    }


def _described(model: Model) -> str:
    """A model's file and how its weights are held (the same file may be either)."""
    return f"{model.source or model.info.arch} ({model.halves.kind} halves)"


def _agreement(draft: Model, engine: Engine, prompts: list[list[int]]) -> float:
    """The share of ``engine``'s greedy tokens for ``prompts`` that ``draft`` predicts
    greedily from the same context (its logits teacher-forced over prompt and output): the
    per-token acceptance its drafts would have, whether or not the engine chose to draft."""
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    hits = total = 0
    for prompt in prompts:
        output = list(engine.submit(prompt, params).result().tokens)
        if not output:
            continue
        logits = teacher_forced_logits(draft, [*prompt, *output[:-1]])[len(prompt) - 1 :]
        hits += sum(int(p == t) for p, t in zip(logits.argmax(-1).tolist(), output, strict=True))
        total += len(output)
    return hits / total if total else 0.0


def _streams(prompts: list[list[int]], streams: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(streams)]


def _delivered_rate(
    engine: Engine, prompts: list[list[int]]
) -> tuple[float, list[tuple[int, ...]]]:
    """Run ``prompts`` at once; delivered tokens a second, and each one's tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    handles = [engine.submit(p, params) for p in prompts]
    results: list[Finished] = [h.result() for h in handles]
    firsts = [r.timings.token_times[0] for r in results if r.timings.token_times]
    lasts = [r.timings.token_times[-1] for r in results if r.timings.token_times]
    tokens = sum(max(len(r.timings.token_times) - 1, 0) for r in results)
    span = max(lasts) - min(firsts) if firsts else 0.0
    time.sleep(0.05)  # the engine thread goes idle between runs
    return (tokens / span if span > 0 else 0.0), [r.tokens for r in results]


def speculative_section(result: dict[str, Any]) -> list[str]:
    """The markdown section of a ``speculative`` run."""

    def rate(figure: dict[str, float]) -> str:
        return f"{figure['median']:.1f} [{figure['min']:.1f}–{figure['max']:.1f}]"

    lines = [
        "## speculative: n-gram speculation on and off",
        "",
        f"Greedy, {result['max_new_tokens']} new tokens, flat layout; slotserve with n-gram "
        "speculation on and off, taking turns; delivered tokens a second (median [min–max] "
        f"over {result['repeats']} repeat(s) of each prompt).",
        *(
            [
                f"Rows marked 'draft model' draft with {result['draft_model']} instead; the "
                "share of the target's greedy tokens it predicts (its per-token acceptance, "
                "whether or not the engine chose to draft): "
                + ", ".join(
                    f"{row['workload']} {row['draft_agreement']:.0%}"
                    for row in result["rows"]
                    if "draft_agreement" in row
                )
                + "."
            ]
            if result.get("draft_model")
            else []
        ),
        "",
        "| workload | streams | on tok/s | off tok/s | on / off | drafted | accepted | "
        "acceptance | same output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['workload']} | {row['streams']} | {rate(row['tok_s_on'])} | "
            f"{rate(row['tok_s_off'])} | {row['speedup']['median']:.2f}x | {row['drafted']} | "
            f"{row['accepted']} | {row['acceptance']:.0%} | {row['same_output']} |"
        )
    lines.append("")
    llama = result.get("llama_server", {})
    if "skipped" in llama:
        return [*lines, f"llama-server: not run ({llama['skipped']}).", ""]
    if not llama:
        return lines
    ours = {
        row["workload"]: row
        for row in result["rows"]
        if row["streams"] == 1 and not row["workload"].endswith("draft model")
    }
    lines += [
        f"llama-server (llama-cpp-python {llama['llama_cpp_python']}'s llama.cpp, "
        f"{llama['threads']} threads) on {llama.get('file', 'the same file')} (the weights "
        "slotserve runs) and the same prompts, one stream, by `--spec-type`; delivered "
        "tok/s, and slotserve with speculation over it:",
        "",
        "| --spec-type | " + " | ".join(f"{w} tok/s | slotserve / it" for w in ours) + " |",
        "|---|" + "---|---|" * len(ours),
    ]
    for spec, workloads in llama["rows"].items():
        cells = []
        for workload, row in ours.items():
            theirs = workloads[workload]["median"]
            ratio = row["tok_s_on"]["median"] / theirs if theirs > 0 else 0.0
            cells += [rate(workloads[workload]), f"{ratio:.2f}x"]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return [*lines, "", *_llama_draft_lines(result, rate)]


def _llama_draft_lines(
    result: dict[str, Any], rate: Callable[[dict[str, float]], str]
) -> list[str]:
    """The table of llama-server's ``--model-draft`` beside slotserve's draft-model rows
    (nothing without a draft model)."""
    draft = result["llama_server"].get("draft")
    if draft is None:
        return []
    if "skipped" in draft:
        return [f"llama-server with a draft model: not run ({draft['skipped']}).", ""]
    suffix = ", draft model"
    ours = {
        row["workload"].removesuffix(suffix): row
        for row in result["rows"]
        if row["streams"] == 1 and row["workload"].endswith(suffix)
    }
    lines = [
        f"llama-server with `--model-draft {draft['file']}` (`--spec-type draft-simple`, its "
        "default draft length) beside slotserve drafting with the same model, one stream:",
        "",
        "| workload | slotserve, draft model, tok/s | llama-server `--model-draft` tok/s | "
        "slotserve / it |",
        "|---|---|---|---|",
    ]
    for workload, row in ours.items():
        theirs = draft["rows"][workload]
        ratio = row["tok_s_on"]["median"] / theirs["median"] if theirs["median"] > 0 else 0.0
        lines.append(f"| {workload} | {rate(row['tok_s_on'])} | {rate(theirs)} | {ratio:.2f}x |")
    return [*lines, ""]
