"""Flags shared by several commands, and the one mapping of engine flags to `EngineConfig`."""

from __future__ import annotations

import argparse

from slotserve.engine.config import EngineConfig
from slotserve.plan import MemoryMap, parse_bytes


def add_weights_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=["fp32", "int8"],
        default="fp32",
        help="int8: quantised projections, faster decode, less exact",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Model and sampling flags of the single-caller commands (generate, chat)."""
    parser.add_argument("--model", default="bundled", help="'bundled', a .gguf file or an HF dir")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-context", type=int, default=None)
    add_weights_arg(parser)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that sizes a KV pool (read by `engine_config`)."""
    parser.add_argument("--model", default="bundled", help="'bundled', a .gguf file or an HF dir")
    add_weights_arg(parser)
    parser.add_argument("--max-seqs", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--kv-layout", choices=["flat", "ring", "cell"], default="flat")
    parser.add_argument("--kv-dtype", choices=["fp32", "fp16", "bf16", "int8"], default="fp32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="cell layout: blocks in the pool"
    )
    parser.add_argument("--ring-window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=0)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--policy", choices=["isolate", "fifo"], default="isolate")
    parser.add_argument("--queue-depth", type=int, default=0)
    parser.add_argument("--queue-timeout", type=float, default=30.0)
    parser.add_argument("--memory-budget", default=None, help="e.g. 1GiB, 512MB, 1073741824")
    parser.add_argument(
        "--memory-map",
        default=None,
        metavar="W,K,A",
        help="per-arena budgets: weights,kv,activations (e.g. 600MiB,256MiB,128MiB)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """An `EngineConfig` from the flags of `add_engine_args`."""
    return EngineConfig(
        max_seqs=args.max_seqs,
        max_context=args.max_context,
        kv_layout=args.kv_layout,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        ring_window=args.ring_window,
        sinks=args.sinks,
        num_blocks=args.num_blocks,
        memory_budget=parse_bytes(args.memory_budget) if args.memory_budget else None,
        memory_map=memory_map_from(args.memory_map),
        policy=args.policy,
        max_batch_tokens=args.max_batch_tokens,
        queue_depth=args.queue_depth,
        queue_timeout_s=args.queue_timeout,
    )


def memory_map_from(text: str | None) -> MemoryMap | None:
    """``"600MiB,256MiB,128MiB"`` (weights,kv,activations) → `MemoryMap`."""
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 3:
        raise ValueError(f"--memory-map {text!r}: expected weights,kv,activations")
    return MemoryMap.parse(*parts)
