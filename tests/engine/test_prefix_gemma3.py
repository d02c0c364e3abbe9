"""Exactness and the prefix cache's retention rules on real weights: Gemma 3 270M, whose five
local layers in six keep only the last 512 positions (a ring). Four conversations whose
histories pass the window give the same tokens and log-probabilities, bit for bit, run
co-batched with the cache off and one at a time with it on. A token-equal prefix that a
ring has overwritten is refused and counted by rule; a conversation's own next turn
extends its snapshot and restores."""

from __future__ import annotations

from collections.abc import Callable

import slotserve as ss
from tests.engine.test_exactness import Trace, trace

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=5)
CONFIG = {"kv_layout": "cell", "block_size": 16, "max_seqs": 2, "max_context": 1024}
SYSTEM = (
    "You are the archivist of a small coastal town. You keep the records of ships, storms, "
    "births and harvests, and you answer questions about them plainly and briefly. "
)


def test_cache_on_equals_cache_off_past_the_window(
    gemma3: ss.Model, make_engine: Callable[..., ss.Engine]
) -> None:
    encode = gemma3.tokenizer.encode
    system = encode(SYSTEM * 16)
    window = gemma3.info.window(0)
    assert window is not None and len(system) > window
    questions = [
        " When did the great storm come?",
        " Who built the lighthouse?",
        " What was the harvest like last year?",
        " Which ship was lost at sea?",
    ]
    first = [system + encode(q, add_bos=False) for q in questions]
    follow = encode(" And after that?", add_bos=False)
    # Cache off, the four conversations co-batched.
    off = make_engine(gemma3, **{**CONFIG, "max_seqs": 4})
    turns = [trace(h) for h in [off.submit(p, GREEDY) for p in first]]
    seconds = [[*p, *tokens(t), *follow] for p, t in zip(first, turns, strict=True)]
    expected = turns + [trace(h) for h in [off.submit(p, GREEDY) for p in seconds]]
    # Cache on, each conversation's two turns in turn.
    engine = make_engine(gemma3, **CONFIG, prefix_cache_bytes="256MiB")
    got, cached = [], []
    for prompt in first:
        handle = engine.submit(prompt, GREEDY, publish_completion=True)
        turn = trace(handle)
        cached.append(handle.result().usage.cached_tokens)
        handle = engine.submit([*prompt, *tokens(turn), *follow], GREEDY)
        got += [turn, trace(handle)]
        cached.append(handle.result().usage.cached_tokens)
        engine.check_integrity()
    assert got[0::2] + got[1::2] == expected  # tokens, logprobs and top 5: bit for bit
    # Conversations 2-4 share 1's system prompt token for token, but the rings of every
    # snapshot were written past it: positions a local layer needs were overwritten.
    assert cached[0::2] == [0, 0, 0, 0]
    # Each follow-up extends its own conversation's snapshot: restored, far past the window.
    for prompt, follow_cached in zip(first, cached[1::2], strict=True):
        assert follow_cached >= len(prompt)
    stats = engine.stats().prefix
    assert stats is not None
    assert stats.rejections >= 3 and stats.rejections_by_rule.get("ring_wrapped") == (
        stats.rejections
    )


def tokens(turn: Trace) -> list[int]:
    return [token for token, _, _ in turn]
