"""Whether the runner keeps a conversation's KV between turns: `slotserve serve`'s rule.

The prefix cache is on by default only where a restored prefix gives bit for bit the logits
of computing it again (`slotserve.engine.prefix_share.is_exact`: block halves on the
compiled kernels, the attention kernel on). A bundle's program, dense and int8 weights
(Hugging Face directories, ``weights="fp32"``) and torch's attention are not exact there, so
a runner on them computes each turn's whole conversation unless its caller turns the cache
on anyway. Owns: that decision and its reason; the cache's size is the runner's.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.engine import EngineConfig
from slotserve.engine.prefix_share import is_exact
from slotserve.model import Model


@dataclass(frozen=True)
class CacheChoice:
    """The runner's prefix cache: ``on`` or not, as ``asked`` (True, False, or None: the
    default rule) on a model where restoring is ``exact`` or not (``inexact``: why not)."""

    on: bool
    asked: bool | None
    exact: bool
    inexact: str = ""

    def describe(self, on_switch: str, off_switch: str) -> str:
        """The choice in a line for the log, naming the caller's switches (a keyword, or a
        command's flags)."""
        if self.asked is False:
            return f"prefix cache off ({off_switch})"
        if self.asked:
            though = "" if self.exact else f", though {self.inexact}"
            return f"prefix cache on ({on_switch}){though}"
        if self.on:
            return (
                f"prefix cache on: restoring the conversation is bit-exact here ({off_switch}: off)"
            )
        return (
            f"prefix cache off: {self.inexact}; every turn computes the whole conversation "
            f"({on_switch} turns it on anyway)"
        )


def choose_prefix_cache(model: Model, config: EngineConfig, asked: bool | None) -> CacheChoice:
    """The cache for ``model`` served with ``config``: ``asked`` True or False decides;
    None (the default) turns it on only where restoring is exact."""
    exact = is_exact(model, config)
    on = exact if asked is None else asked
    return CacheChoice(on, asked, exact, "" if exact else _why_inexact(model, config))


def _why_inexact(model: Model, config: EngineConfig) -> str:
    attention = model.kernels.attention is not None and config.kernels == "auto"
    return (
        f"{model.source} runs {model.halves.kind} halves with the attention kernel "
        f"{'on' if attention else 'off'}, where a restored prefix is not bit-exact "
        "(exact: GGUF block weights on the compiled kernels)"
    )
