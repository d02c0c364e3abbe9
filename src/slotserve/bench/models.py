"""Scenario ``models``: a chat model and an embedding model on one device, in one slotserve
process (`docs/MODELS.md`) beside separate processes and llama.cpp's servers. Three parts:

- **A chat turn beside indexing** (`slotserve.bench.models_index`): the chat turn's
  inter-token latency while the embedding model indexes `PASSAGES` passages in the
  background: both models in one slotserve process; slotserve's chat process beside a
  llama-server ``--embeddings`` process (a slotserve process serves an embedding model
  only beside a resident chat model); and two llama-server processes (the chat GGUF, and
  ``--embeddings`` on the embedding model converted by llama.cpp's own converter,
  `make_minilm_gguf`).
- **Embedding throughput**: texts per second of slotserve's encoder and of
  sentence-transformers in this process on the same texts (`slotserve.bench.embeddings`,
  the first `IN_PROCESS_TEXTS`), and of the indexing job alone over HTTP on each setup
  above.
- **Switching** (`slotserve.bench.models_switch`): the first token after asking for a chat
  model that is not loaded, and the process tree's memory, on slotserve's model set and on
  llama-server's router with one model at a time, on the same files.

The passages are `slotserve.bench.embeddings.passages`, each cut to the embedding model's
token limit (what sentence-transformers and slotserve embed of it) so that llama-server,
which does not truncate, embeds the same tokens. A part that cannot run (llama-server not
built, a model not a GGUF, a model not installed, a conversion that fails) is skipped with
its reason in the result and the report.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from slotserve.bench.models_index import (
    CHAT_CONTEXT,
    INDEX_S,
    ONE_PROCESS,
    SLOTSERVE_BESIDE_LLAMA,
)
from slotserve.bench.stats import format_summary, markdown_table
from slotserve.model import Model

EMBEDDER = "minilm"
OTHER = "gemma3-270m"  # the second chat model of the switching part
PASSAGES = 1000
IN_PROCESS_TEXTS = 256  # the in-process comparison's share of them (two runtimes, one run)
BATCH = 32  # passages per embeddings request
TURN_TOKENS = 64
CHAT_SLOTS = 2
ITL_TARGET = 1.15  # issue 49: the turn beside the indexing, over the turn alone


def progress_printer() -> Callable[[str], None]:
    """Progress lines on stderr (the result goes to stdout)."""

    def say(text: str) -> None:
        print(f"bench models: {text}", file=sys.stderr, flush=True)

    return say


def cut_passages(embedder: str, n: int) -> tuple[list[str], int]:
    """`passages` cut to the embedder's token limit as its tokenizer counts them, and the
    tokens of them all (special tokens included)."""
    from slotserve.artifact.encoder import load_encoder
    from slotserve.bench.embeddings import passages

    encoder = load_encoder(embedder)
    ids = encoder.tokenize(passages(n))
    texts = [encoder.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    return texts, sum(len(row) for row in encoder.tokenize(texts))


def on_cores(threads: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()`` with torch's ops on ``threads`` threads, as the servers' processes have
    them (loading a model on the block kernels left this process's torch on one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def served_name(spec: str, taken: set[str]) -> str:
    """A model-set name for ``spec`` (a TOML bare key, a GGUF file stem), unlike ``taken``."""
    base = re.sub(r"[^A-Za-z0-9_-]", "-", Path(spec).stem if "/" in spec else spec)
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    return name


def llama_peers(model: Model, embedder: str, convert: bool) -> dict[str, Any]:
    """What the llama-server parts need: ``binary``, the chat model's GGUF ``chat``, the
    embedding model's GGUF ``embed``, each with ``missing[part]``, why it is absent, when
    it is."""
    from slotserve.artifact.minilm import MINILM_ALIASES
    from slotserve.bench.llama_server import (
        find_llama_server,
        make_minilm_gguf,
        minilm_gguf_path,
    )
    from slotserve.bench.servers import gguf_of

    peers: dict[str, Any] = {"binary": find_llama_server(), "chat": None, "embed": None}
    missing: dict[str, str] = {}
    if peers["binary"] is None:
        missing["binary"] = "llama-server is not built; `make bench-deps` builds it"
    try:
        peers["chat"] = gguf_of(model, None)
    except ValueError as exc:
        missing["chat"] = str(exc)
    if embedder not in MINILM_ALIASES:
        missing["embed"] = f"only MiniLM is converted to GGUF here, not {embedder}"
    elif minilm_gguf_path().is_file() or convert:
        try:
            peers["embed"] = make_minilm_gguf()
        except RuntimeError as exc:
            missing["embed"] = f"llama.cpp's convert_hf_to_gguf.py failed: {exc}"
    else:
        missing["embed"] = "MiniLM is not converted to GGUF; `make bench-deps` converts it"
    peers["missing"] = missing
    return peers


def default_resident() -> str | None:
    """The resident chat model of the switching part: the Q4_K_M SmolLM2 that
    ``make bench-deps`` makes (`slotserve.bench.llama_server.make_q4_k_m`), if made."""
    from slotserve.bench.llama_server import smollm2_q4_k_m_path

    path = smollm2_q4_k_m_path()
    return str(path) if path.is_file() else None


def run_models(
    model: Model,
    repeats: int = 3,
    *,
    embedder: str = EMBEDDER,
    other: str | None = OTHER,
    resident: str | None = None,
    passages: int = PASSAGES,
    batch: int = BATCH,
    turn_tokens: int = TURN_TOKENS,
    threads: int | None = None,
    convert: bool = True,
) -> dict[str, Any]:
    """The three parts (see the module docstring) with ``model`` as the chat model and
    ``embedder`` the embedding model. Switching alternates ``model`` and ``other`` (None:
    no switching part) on demand beside ``resident``, the chat model a slotserve set keeps
    loaded (None: `default_resident`). ``convert``: convert the embedder to GGUF for
    llama-server when it is not yet (else those rows are skipped)."""
    from slotserve.bench.embeddings import run_embeddings
    from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION
    from slotserve.bench.models_index import Servers, measure_setup, setups
    from slotserve.bench.servers import PROMPT_TOKENS, numbered_prompts
    from slotserve.native import process_cores

    say = progress_printer()
    threads = threads or process_cores()
    texts, tokens = cut_passages(embedder, passages)
    say(f"{len(texts)} passages, {tokens} tokens; embedding some in this process")
    in_process = on_cores(
        threads, lambda: run_embeddings(embedder, batch=batch, texts=texts[:IN_PROCESS_TEXTS])
    )
    peers = llama_peers(model, embedder, convert)
    servers = Servers(
        chat=model.source,
        chat_gguf=peers["chat"],
        embedder=embedder,
        embed_gguf=peers["embed"],
        binary=peers["binary"],
        threads=threads,
        slots=CHAT_SLOTS,
        context=min(CHAT_CONTEXT, model.info.max_context),
        batch=batch,
        missing=peers["missing"],
    )
    prompts = numbered_prompts(model, repeats + 1, seed=49)
    beside: dict[str, Any] = {}
    for name, start in setups(servers).items():
        if isinstance(start, str):
            beside[name] = {"skipped": start}
            continue
        say(f"{name}: starting")
        with ExitStack() as stack:
            setup = start(stack)
            beside[name] = measure_setup(setup, prompts, turn_tokens, texts, batch, say)
    switching = run_switching(model, other, resident or default_resident(), peers, threads, repeats)
    return {
        "model": model.source,
        "embedder": embedder,
        "threads": threads,
        "passages": len(texts),
        "passage_tokens": tokens,
        "batch": batch,
        "prompt_tokens": PROMPT_TOKENS,
        "turn_tokens": turn_tokens,
        "repeats": repeats,
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "beside_indexing": beside,
        "in_process": in_process,
        "switching": switching,
    }


def run_switching(
    model: Model,
    other: str | None,
    resident: str | None,
    peers: dict[str, Any],
    threads: int,
    repeats: int,
) -> dict[str, Any]:
    """The switching part on slotserve and on llama-server's router, each skipped with a
    reason where it cannot run."""
    from slotserve.artifact import model_path
    from slotserve.bench.models_switch import (
        SWITCH_CONTEXT,
        router_switching,
        slotserve_switching,
    )
    from slotserve.errors import ArtifactError

    if other is None:
        return {"skipped": "no second chat model given"}
    if resident is None:
        return {
            "skipped": "a slotserve set keeps one chat model resident, and none was given: "
            "`make bench-deps` makes the Q4_K_M SmolLM2 it uses"
        }
    try:
        other_path = model_path(other)
    except ArtifactError as exc:
        return {"skipped": str(exc)}
    say = progress_printer()
    first = served_name(model.source, {"chat"})
    chats = {first: model.source, served_name(other, {"chat", first}): other}
    context = min(SWITCH_CONTEXT, model.info.max_context)
    ours = slotserve_switching(resident, chats, threads, repeats, say, context)
    files = dict(zip(chats, (Path(model.source), other_path), strict=True))
    missing = peers["missing"].get("binary")
    if missing is None and any(path.suffix != ".gguf" for path in files.values()):
        missing = "the router needs both models as GGUF files"
    if missing is not None:
        theirs: dict[str, Any] = {"skipped": missing}
    else:
        theirs = router_switching(peers["binary"], files, threads, repeats, say, context)
    return {"resident": resident, "slotserve": ours, "llama-server router": theirs}


def models_section(r: dict[str, Any]) -> list[str]:
    """The markdown section of `run_models`'s result."""
    from slotserve.memory import format_bytes

    lines = [
        "## models: a chat model and an embedding model on one device",
        "",
        f"Chat model `{r['model']}`, embedding model `{r['embedder']}`, {r['threads']} threads "
        f"a process; {r['passages']} passages ({r['passage_tokens']} tokens, each cut to the "
        f"embedding model's limit), {r['batch']} a request; {r['repeats']} repeats after a "
        f"warm-up; llama.cpp from llama-cpp-python {r['llama_cpp_python']}.",
        "",
        f"### models: a chat turn beside indexing (target ≤ {ITL_TARGET}×)",
        "",
        f"A streamed completion of a {r['prompt_tokens']}-token prompt, {r['turn_tokens']} "
        "greedy tokens (`interactive`), alone and then while the indexing job runs (two "
        "requests in flight, `background`, no more sent once the turn has ended); its ITL is "
        "its decode time over its tokens (the server may deliver several a step), the ratio "
        "that beside the job over alone, per repeat, and the p90 is of the gaps between "
        "chunks. Indexing rates are the job's "
        f"alone (through the passages or for {INDEX_S:g} s) and beside the turn; memory is the "
        "setup's processes (resident / anonymous) after the run.",
        "",
    ]
    rows = []
    for name, x in r["beside_indexing"].items():
        if "skipped" in x:
            rows.append([name, f"skipped: {x['skipped']}", *["—"] * 7])
            continue
        rows.append(
            [
                name,
                format_summary(x["itl_ms_alone"]),
                format_summary(x["itl_ms_beside"]),
                f"**{format_summary(x['itl_ratio'], 2)}**",
                f"{x['itl_p90_ms_alone']['median']:.1f} / {x['itl_p90_ms_beside']['median']:.1f}",
                format_summary(x["index_texts_per_s_alone"]),
                format_summary(x["index_texts_per_s_beside"]),
                f"{x['overlap']:.0%}",
                f"{format_bytes(x['resident_bytes'])} / {format_bytes(x['anonymous_bytes'])}",
            ]
        )
    header = [
        "setup",
        "ITL alone ms",
        "beside indexing ms",
        "ratio",
        "gaps' p90 ms alone / beside",
        "indexing texts/s alone",
        "beside the turn",
        "turn inside the job",
        "memory",
    ]
    lines += markdown_table(header, rows)
    lines += _throughput(r)
    lines += _switching(r["switching"])
    return lines


def _throughput(r: dict[str, Any]) -> list[str]:
    x = r["in_process"]
    lines = [
        "### models: embedding throughput",
        "",
        f"In this process, one timed run each after a warm-up batch, batches of {x['batch']}, "
        f"torch on {x['torch_threads']} thread(s): slotserve's `EncoderEngine` "
        f"({x['weights']}) {x['slotserve_texts_per_s']:.1f} texts/s",
    ]
    if "sentence_transformers_texts_per_s" in x:
        lines[-1] += (
            f", sentence-transformers {x['sentence_transformers_texts_per_s']:.1f} texts/s "
            f"(**{x['ratio']:.2f}×**; largest difference {x['max_abs_diff']:.1e})."
        )
    else:
        lines[-1] += f"; sentence-transformers: {x['sentence_transformers']}."
    one = r["beside_indexing"].get(ONE_PROCESS, {})
    peer = r["beside_indexing"].get(SLOTSERVE_BESIDE_LLAMA, {})
    if "index_texts_per_s_alone" in one and "index_texts_per_s_alone" in peer:
        ours = one["index_texts_per_s_alone"]["median"]
        theirs = peer["index_texts_per_s_alone"]["median"]
        per_text = [x["index_tokens_alone"] / x["index_texts_alone"] for x in (one, peer)]
        lines[-1] += (
            f" Over HTTP (the indexing job alone, table above): slotserve {ours:.1f} texts/s, "
            "llama-server `--embeddings` on the GGUF llama.cpp's converter made (f32) "
            f"{theirs:.1f} texts/s (**{ours / theirs:.2f}×**); tokens a text "
            f"{per_text[0]:.1f} and {per_text[1]:.1f}."
        )
    elif "skipped" in peer:
        lines[-1] += f" llama-server `--embeddings`: skipped ({peer['skipped']})."
    return [*lines, ""]


def _switching(s: dict[str, Any]) -> list[str]:
    from slotserve.memory import format_bytes

    lines = ["### models: switching between two chat models that do not both fit", ""]
    if "skipped" in s:
        return [*lines, f"Skipped: {s['skipped']}.", ""]
    ours = s["slotserve"]
    lines += [
        "The two chat models alternate, each request the first since its model was unloaded, "
        "then one more with it loaded: the first streamed token of a short plain completion. "
        f"slotserve: `serve --models` with `{s['resident']}` resident as `chat` (a set "
        "answers its own routes on a resident chat model; it is in slotserve's memory "
        "below, not the router's) and both models on demand, `--memory-budget "
        f"{format_bytes(ours['budget_bytes'])}` (room for one of them); llama-server: its "
        "router, `--models-dir` (links to the same files) `--models-max 1`. One slot each. "
        "Memory: the server's whole process tree, peak sampled through the switches and at "
        "the end, resident / anonymous.",
        "",
    ]
    rows = []
    for server in ("slotserve", "llama-server router"):
        x = s[server]
        if "skipped" in x:
            rows.append([server, "—", f"skipped: {x['skipped']}", "—", "—", "—"])
            continue
        for model in x["models"]:
            rows.append(
                [
                    server,
                    f"`{model}`",
                    format_summary(x["first_token_s_cold"][model], 2),
                    format_summary(x["first_token_ms_warm"][model]),
                    f"{format_bytes(x['peak_resident_bytes'])} / "
                    f"{format_bytes(x['peak_anonymous_bytes'])}",
                    f"{format_bytes(x['resident_bytes'])} / {format_bytes(x['anonymous_bytes'])}"
                    + ("" if x["cold_checked"] else " (a request found its model loaded)"),
                ]
            )
    header = [
        "server",
        "model",
        "first token, unloaded s",
        "first token, loaded ms",
        "peak memory",
        "memory at the end",
    ]
    lines += markdown_table(header, rows)
    planned = ours.get("planned_bytes", {})
    if planned:
        cells = ", ".join(f"`{name}` {format_bytes(n)}" for name, n in planned.items())
        lines += [f"slotserve's plan per model: {cells}.", ""]
    return lines
