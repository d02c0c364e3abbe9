"""The prefix cache's retention rules on real weights: Gemma 3 270M, whose five local layers
in six keep only the last 512 positions (a ring), served with the cache on gives the
cache-off tokens on four conversations whose histories pass the window. A token-equal
prefix that a ring has overwritten is refused and counted by rule; a conversation's own
next turn extends its snapshot and restores."""

from __future__ import annotations

from collections.abc import Callable

import slotserve as ss

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
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
    follow_up = encode(" And after that?", add_bos=False)
    runs = {}
    for name, engine in (
        ("off", make_engine(gemma3, **CONFIG)),
        ("on", make_engine(gemma3, **CONFIG, prefix_cache_bytes="256MiB")),
    ):
        finals = []
        for prompt in first:  # each conversation's two turns
            turn = engine.submit(prompt, GREEDY, publish_completion=True).result()
            finals += [turn, engine.submit([*prompt, *turn.tokens, *follow_up], GREEDY).result()]
            engine.check_integrity()
        runs[name] = finals
    on, off = runs["on"], runs["off"]
    assert [f.tokens for f in on] == [f.tokens for f in off]
    cached = [f.usage.cached_tokens for f in on]
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
