"""``slotserve generate``: stream one completion of a prompt (or print it as JSON).

stdout holds the answer only. Log lines go to stderr, never inside the answer: the ones
logged while it streams wait until it is out (`LogGate`), each distinct message once.
ExecuTorch's stats line (``PyTorchObserver {...}``) is shown with ``--stats`` or ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from slotserve.cli.flags import add_preset_arg, add_sampling_args
from slotserve.cli.log_gate import DropStatsLine, LogGate
from slotserve.engine.config import DRAFT_WEIGHTS, SPECULATE_MODES, SpeculateMode

log = logging.getLogger("slotserve")


def register(commands: Any) -> None:
    parser = commands.add_parser("generate", help="stream a completion of PROMPT")
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--stats",
        action="store_true",
        help="log ExecuTorch's stats line (PyTorchObserver {...}) on stderr after the answer",
    )
    add_sampling_args(parser)
    add_preset_arg(parser)
    parser.add_argument(
        "--memory-budget", default=None, help="with --preset: the budget it sizes for"
    )
    parser.add_argument(
        "--speculate",
        choices=SPECULATE_MODES,
        default=None,
        help="ngram (default): verify tokens drafted from the prompt and output in one step, "
        "the output unchanged bit for bit (where the model keeps that exact); draft: tokens "
        "drafted by --draft-model (the default with it); off: one token a step",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="SPEC",
        help="a model of the same vocabulary that drafts tokens (--speculate draft): a "
        "smaller one of the family, or the same file in another --draft-weights",
    )
    parser.add_argument(
        "--draft-weights",
        choices=DRAFT_WEIGHTS,
        default="auto",
        help="how --draft-model's weights are held (as --weights)",
    )


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
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    stats_line = None if args.stats or args.json else DropStatsLine()
    runner_log = logging.getLogger("slotserve.runner")
    if stats_line is not None:
        runner_log.addFilter(stats_line)
    try:
        with LogGate() as gate:
            return _generate_gated(args, gate)
    finally:
        if stats_line is not None:
            runner_log.removeFilter(stats_line)


def _generate_gated(args: argparse.Namespace, gate: LogGate) -> int:
    from slotserve.runner import TextLLMRunner

    model, context = _model_and_context(args)
    default: SpeculateMode = "draft" if args.draft_model else "ngram"
    speculate: SpeculateMode = args.speculate or default
    runner = TextLLMRunner(
        model,
        max_context=context,
        weights=args.weights,
        speculate=speculate,
        draft_model=args.draft_model if speculate == "draft" else None,
        draft_weights=args.draft_weights,
    )
    runner.load()
    tokenizer = runner.model.tokenizer
    if args.chat:
        # Token ids, not rendered text: special-token text the user typed stays text.
        prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:  # with the model's BOS rule, as llama.cpp tokenises a prompt (the runner adds none)
        prompt = tokenizer.encode(args.prompt)
    if args.json:
        result = runner.generate(prompt, generation_config(args))
    else:
        with gate.holding():  # the answer streams: log lines wait until it is out
            result = runner.generate(prompt, generation_config(args), token_callback=print_piece)
            sys.stderr.write("\n")  # the lines that waited start on a line of their own
    if args.json:
        report = {
            "tokens": result.tokens,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
        }
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(f"[{summary(result)}]", file=sys.stderr)
    return 0


def _model_and_context(args: argparse.Namespace) -> tuple[Any, int | None]:
    """The runner's model (spec, or loaded here when ``--preset`` must size for it) and
    its context: ``--max-context``, else the preset's. generate runs one request on the
    runner's one-slot flat engine, so of a preset only its context applies (logged)."""
    if args.preset is None:
        return args.model, args.max_context
    from slotserve.artifact import load
    from slotserve.engine.presets import preset_config

    model = load(args.model, weights=args.weights)
    config = preset_config(args.preset, model, args.memory_budget)
    log.info(
        "preset %s: max_context=%d; generate serves one request on a one-slot flat engine, "
        "so the preset's layout (%s), concurrency and queue do not apply here",
        args.preset,
        config.max_context,
        config.kv_layout,
    )
    return model, args.max_context or config.max_context


def summary(result: Any) -> str:
    """One line on a `GenerationResult`: its token counts, decode rate and finish reason."""
    stats = result.stats
    rate = stats.decode_tokens_per_s
    decode = f"{rate:.1f} tok/s decode" if rate is not None else "decode rate n/a"
    return (
        f"{stats.num_prompt_tokens} prompt tokens, {len(result.tokens)} generated, "
        f"{decode}, {result.finish_reason}"
    )
