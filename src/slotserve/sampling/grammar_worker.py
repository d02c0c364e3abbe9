"""The grammar worker's program: one process of the compile pool (compile_pool.py's
`Worker` starts it as ``python -I grammar_worker.py``).

It imports the standard library and llguidance, nothing of slotserve (whose import brings
torch), so the worker stays small and its memory is the compile's. It builds the tokenizer
index once from the source its parent sends, then compiles one job at a time and replies
with what the grammar keeps (malloc's bytes in use), or why it cannot be used. The parent
measures its time and memory from outside and kills it past a bound; the worker itself runs
at the lowest CPU priority and dies with its parent.

Frames are a little-endian u32 length and a pickle, both ways; the parent is the only peer.
Requests: first ``(source, n_vocab, eos_ids)``, then ``(kind, text, json_options, limits)``
per job. Replies: ``("ready", bare_anonymous_bytes)`` once, then per job one of ``("ok",
kept_bytes)``, ``("schema", message)``, ``("convert", message)``, ``("error", message)`` or
``("empty",)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

PR_SET_PDEATHSIG = 1


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: the heap's bytes in use, as malloc counts them."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


class Tokens:
    """A vocabulary sent as a dict (a SentencePiece model's tokens), as llguidance's
    `TokenizerWrapper` reads one. Compiling never encodes text."""

    def __init__(self, source: dict[str, Any]) -> None:
        self.tokens = source["tokens"]
        self.eos_token_id = source["eos_token_id"]
        self.bos_token_id = source["bos_token_id"]
        self.special_token_ids = source["special_token_ids"]

    def __call__(self, text: str) -> list[int]:
        return []


def receive(stream: BinaryIO) -> Any:
    """The parent's next message; exits quietly when the parent closed the pipe."""
    head = stream.read(4)
    if len(head) < 4:
        sys.exit(0)
    return pickle.loads(stream.read(struct.unpack("<I", head)[0]))


def send(stream: BinaryIO, message: object) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def anonymous_bytes() -> int:
    """This process's anonymous resident bytes (RssAnon): the heap, not code pages."""
    try:
        with open("/proc/self/status") as status:
            return next(
                int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:")
            )
    except (OSError, ValueError, IndexError, StopIteration):
        return 0


def heap_in_use() -> Callable[[], int]:
    """How the bytes a grammar keeps are read: malloc's own count where glibc has it, else
    the anonymous resident bytes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return anonymous_bytes

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


def compile_job(
    index: Any,
    eos: set[int],
    job: tuple[str, str, dict[str, Any], dict[str, Any]],
    in_use: Callable[[], int],
) -> tuple[Any, ...]:
    """The reply to one job: compile it against ``index`` under its limits, check that it
    admits a first token other than the ``eos`` ids and can follow its forced tokens, and
    measure what it keeps."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind, text, options, limits = job
    before = in_use()
    try:
        grammar = (
            llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)  # type: ignore[arg-type]
            if kind == "schema"
            else text
        )
    except ValueError as exc:
        return ("schema", str(exc))
    try:
        if kind == "gbnf":
            grammar = any_to_lark(text)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
    except (Exception, RecursionError) as exc:
        return ("convert", str(exc) or type(exc).__name__)
    matcher = llguidance.LLMatcher(
        index, grammar, log_level=0, limits=llguidance.LLParserLimits(**limits)
    )
    if matcher.is_error():
        return ("error", matcher.get_error())
    start = matcher.deep_copy()
    bits = int.from_bytes(start.compute_bitmask(), "little")
    allowed = bin(bits).count("1") - sum(bits >> e & 1 for e in eos)
    if start.is_error() or allowed <= 0:
        return ("empty",)
    forced = start.compute_ff_tokens()
    if (forced and not start.consume_tokens(forced)) or start.is_error():
        reason = start.get_error().strip().splitlines()[0]
        return (
            "error",
            f"the grammar engine cannot follow it past its first {len(forced)} tokens "
            f"({reason}); simplify the schema (fewer properties or alternatives)",
        )
    del start
    kept = max(in_use() - before, 0)
    del matcher
    return ("ok", kept)


def main() -> None:
    """Serve the parent's jobs until it closes the pipe (or dies: PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError):
        os.nice(19)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    read, write = sys.stdin.buffer, sys.stdout.buffer
    bare = anonymous_bytes()  # before llguidance is imported
    in_use = heap_in_use()
    import llguidance

    source, n_vocab, eos = receive(read)
    if isinstance(source, dict):
        source = llguidance.TokenizerWrapper(Tokens(source))
    index = llguidance.LLTokenizer(source, n_vocab=n_vocab, eos_token=eos)
    send(write, ("ready", bare))
    while True:
        send(write, compile_job(index, set(eos), receive(read), in_use))


if __name__ == "__main__":
    main()
