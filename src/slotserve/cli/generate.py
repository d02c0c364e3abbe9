"""``slotserve generate``: stream one completion of a prompt (or print it as JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from slotserve.cli.flags import add_sampling_args


def register(commands: Any) -> None:
    parser = commands.add_parser("generate", help="stream a completion of PROMPT")
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    add_sampling_args(parser)


def generation_config(args: argparse.Namespace) -> Any:
    """The `GenerationConfig` of the sampling flags (shared with ``chat``)."""
    from slotserve.runner import GenerationConfig

    return GenerationConfig(
        echo=False,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )


def print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from slotserve.runner import TextLLMRunner

    runner = TextLLMRunner(args.model, max_context=args.max_context, weights=args.weights)
    runner.load()
    prompt: str | list[int] = args.prompt
    if args.chat:
        # Token ids, not rendered text: special-token text the user typed stays text.
        prompt = runner.model.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    callback = None if args.json else print_piece
    result = runner.generate(prompt, generation_config(args), token_callback=callback)
    if args.json:
        report = {
            "tokens": result.tokens,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
        }
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(f"\n[{summary(result)}]", file=sys.stderr)
    return 0


def summary(result: Any) -> str:
    """One line on a `GenerationResult`: its token counts, decode rate and finish reason."""
    stats = result.stats
    rate = stats.decode_tokens_per_s
    decode = f"{rate:.1f} tok/s decode" if rate is not None else "decode rate n/a"
    return (
        f"{stats.num_prompt_tokens} prompt tokens, {len(result.tokens)} generated, "
        f"{decode}, {result.finish_reason}"
    )
