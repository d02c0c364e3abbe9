"""Implementations of the ``generate``, ``chat`` and ``inspect`` commands."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from slotserve.runner import TextLLMRunner
from slotserve.runner_types import GenerationConfig


def _config(args: argparse.Namespace) -> GenerationConfig:
    return GenerationConfig(
        echo=False,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def run_generate(args: argparse.Namespace) -> int:
    runner = TextLLMRunner(args.model, max_context=args.max_context, weights=args.weights)
    runner.load()
    prompt = args.prompt
    if args.chat:
        prompt = runner.model.tokenizer.render_chat([{"role": "user", "content": prompt}])
    callback = None if args.json else _print_piece
    result = runner.generate(prompt, _config(args), token_callback=callback)
    if args.json:
        from slotserve.cli import print_json

        print_json(
            {
                "tokens": result.tokens,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "stats": result.stats.to_dict(),
            }
        )
    else:
        stats = result.stats
        print(
            f"\n[{stats.num_prompt_tokens} prompt tokens, {stats.num_generated_tokens} generated, "
            f"{stats.decode_tokens_per_s:.1f} tok/s decode, {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """A terminal chat. Each turn renders the whole conversation and reuses the KV of the
    longest prefix already in the runner's slot, so only the new turn is prefilled."""
    runner = TextLLMRunner(args.model, max_context=args.max_context, weights=args.weights)
    runner.load()
    tokenizer = runner.model.tokenizer
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    in_cache: list[int] = []
    print("slotserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        tokens = tokenizer.encode(tokenizer.render_chat(messages))
        reuse = _common_prefix(in_cache, tokens, runner.position)
        result = runner.generate_from_pos(
            tokens[reuse:], reuse, _config(args), token_callback=_print_piece
        )
        print()
        messages.append({"role": "assistant", "content": result.text})
        in_cache = tokens + result.tokens
    return 0


def _common_prefix(cached: list[int], tokens: list[int], limit: int) -> int:
    n = 0
    for a, b in zip(cached[:limit], tokens, strict=False):
        if a != b:
            break
        n += 1
    return min(n, len(tokens) - 1)


def run_inspect(args: argparse.Namespace) -> int:
    from slotserve.artifact import load
    from slotserve.cli import print_json

    model = load(args.model)
    info = model.info
    print_json(
        {
            "source": model.source,
            "name": info.name,
            "arch": info.arch,
            "layers": info.n_layers,
            "dim": info.dim,
            "heads": info.n_heads,
            "kv_heads": info.n_kv_heads,
            "head_dim": info.head_dim,
            "ffn_dim": info.ffn_dim,
            "vocab_size": info.vocab_size,
            "max_context": info.max_context,
            "rope": vars(info.rope),
            "sliding_window": list(info.sliding_window),
            "tied_embeddings": info.tied_embeddings,
            "bos_id": info.bos_id,
            "eos_ids": list(info.eos_ids),
            "parameters": model.weights.n_params,
            "weight_bytes": model.weight_bytes,
            "kv_bytes_per_token_fp32": info.kv_bytes_per_token(4),
            "chat_template": model.tokenizer.chat_template is not None,
        }
    )
    return 0
