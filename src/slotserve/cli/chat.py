"""``slotserve chat``: a terminal chat with the model.

Each turn encodes the whole conversation with `Tokenizer.encode_chat` (special-token text a
user types stays text) and places only its new tokens after the longest prefix the
runner's conversation already holds (`TextLLMRunner.generate_from_pos`). Where restoring a
prefix is bit-exact (`slotserve serve`'s rule, `slotserve.runner.caching`; logged at start
with the reason), the runner's prefix cache keeps the conversation's KV between turns (each
turn's prompt and reply), so a turn computes only the tokens that differ from it: the new
message, the template's markers around it, and any reply tokens the template encodes
differently (their sliding-window layers too: a turn continues where their rings end).
Elsewhere (a bundle, dense or int8 weights) each turn computes the whole conversation, unless
``--prefix-cache`` keeps the KV anyway.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from slotserve.cli.flags import add_sampling_args
from slotserve.cli.generate import generation_config, print_piece

log = logging.getLogger("slotserve.chat")


def register(commands: Any) -> None:
    parser = commands.add_parser("chat", help="interactive terminal chat")
    parser.add_argument("--system", default=None, help="system message")
    caching = parser.add_mutually_exclusive_group()
    caching.add_argument(
        "--prefix-cache",
        action="store_true",
        help="keep the conversation's KV between turns even where a restore is not "
        "bit-exact (default: only where it is: GGUF block weights on the compiled kernels)",
    )
    caching.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute the whole conversation every turn",
    )
    add_sampling_args(parser)


def run(args: argparse.Namespace) -> int:
    return _chat(args)


def _chat(args: argparse.Namespace) -> int:
    from slotserve.runner import TextLLMRunner, common_prefix

    # The runner's per-turn stats report (an info log line) would interleave with the chat.
    logging.getLogger("slotserve.runner").setLevel(logging.WARNING)
    runner = TextLLMRunner(
        args.model,
        max_context=args.max_context,
        weights=args.weights,
        prefix_cache=True if args.prefix_cache else False if args.no_prefix_cache else None,
    )
    runner.load()
    choice = runner.prefix_cache_choice
    assert choice is not None  # decided by load()
    log.info("%s", choice.describe("--prefix-cache", "--no-prefix-cache"))
    tokenizer = runner.model.tokenizer
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    in_conversation: list[int] = []
    print("slotserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        tokens = tokenizer.encode_chat(messages)  # typed special-token text stays text
        keep = common_prefix(in_conversation, tokens, runner.position)
        result = runner.generate_from_pos(
            tokens[keep:], keep, generation_config(args), token_callback=print_piece
        )
        print()
        messages.append({"role": "assistant", "content": result.text})
        in_conversation = tokens + result.tokens
    return 0
