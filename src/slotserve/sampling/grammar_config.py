"""The words the grammar compiler (grammar.py) and its pool of worker processes
(compile_pool.py) share: the bounds on a compile (`GrammarConfig`), what a job's text is
(`JobKind`), the errors a compile ends with, and what a grammar is charged in the memory plan.

Both modules import these from here, so neither imports the other's definitions back.
Module state: none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# JSON output uses fixed separators and no other whitespace: a small model offered free
# whitespace can emit newlines until its budget runs out, and compact output stays short.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own estimate of one lexer state ("approx. 1-2 kB per state"), the upper one.
LEXER_STATE_BYTES = 2048
MIB = 2**20

# What a job's text is: a JSON schema, llguidance's own grammar text (Lark, as
# llguidance reads it), a llama.cpp GBNF grammar (converted to Lark: llguidance's
# converter, which passes Lark through), or a regular expression (the whole output).
JobKind = Literal["schema", "grammar", "gbnf", "regex"]


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain decoding: invalid, using a feature
    the grammar engine does not implement or cannot enforce (the message names it), or past
    a bound of `GrammarConfig` (`GrammarLimitError`)."""


class GrammarLimitError(GrammarError):
    """A schema whose compile went past a bound: ``limit`` names it (``"timeout"``,
    ``"memory"``), ``bound`` is its value (seconds or bytes)."""

    def __init__(self, message: str, limit: str, bound: float) -> None:
        super().__init__(message)
        self.limit, self.bound = limit, bound


class GrammarBusy(RuntimeError):
    """No compile slot came free before the queue's deadline (``queue_timeout_s``)."""


class GrammarCancelled(RuntimeError):
    """The compile was cancelled (its client went away, or the compiler was closed)."""


@dataclass(frozen=True)
class GrammarConfig:
    """The bounds on compiling grammars from schemas a client sent.

    ``timeout_s``: wall seconds one compile may take in its worker (``--grammar-timeout``).
    ``max_bytes``: one grammar's memory (``--grammar-max-bytes``): its worker may grow by at
    most this while compiling, and what the grammar keeps, plus what its lexer may add as
    requests use it (``lexer_states`` states, a quarter of ``max_bytes``), must fit in it.
    ``cache_bytes``: the grammars arena of the memory plan, every grammar alive (cached or
    in use) counted (``--grammar-cache-bytes``). ``workers``: compiles at once
    (``--grammar-workers``). ``queue_timeout_s``: how long a compile may wait for a worker
    (``--grammar-queue-timeout``).
    """

    timeout_s: float = 10.0
    max_bytes: int = 32 * MIB
    cache_bytes: int = 128 * MIB
    workers: int = 1
    queue_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, flag in (("timeout_s", "timeout"), ("queue_timeout_s", "queue-timeout")):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"grammar {name}={value!r} must be a number of seconds > 0: "
                    f"pass e.g. --grammar-{flag} 10"
                )
        if self.max_bytes < 4 * MIB:
            raise ValueError(
                f"grammar max_bytes={self.max_bytes} is below the least a grammar needs, "
                f"{4 * MIB} (4 MiB): pass e.g. --grammar-max-bytes 32MiB"
            )
        if self.cache_bytes < self.max_bytes:
            raise ValueError(
                f"grammar cache_bytes={self.cache_bytes} is below max_bytes={self.max_bytes}: "
                "the cache must hold at least one grammar; raise --grammar-cache-bytes or "
                "lower --grammar-max-bytes"
            )
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise ValueError(
                f"grammar workers={self.workers!r} must be an integer in 1..64: "
                "pass e.g. --grammar-workers 1"
            )

    @property
    def lexer_states(self) -> int:
        """The lexer states one grammar may build (llguidance's ``max_lexer_states``)."""
        return self.max_bytes // 4 // LEXER_STATE_BYTES

    @property
    def lexer_bytes(self) -> int:
        """The bytes those states may take: charged to every grammar up front."""
        return self.lexer_states * LEXER_STATE_BYTES

    def limits(self) -> dict[str, int]:
        """llguidance's `LLParserLimits` for grammars under this config."""
        return {"max_lexer_states": self.lexer_states}


def grammar_charge(kept: int, config: GrammarConfig) -> int:
    """What a grammar is charged in the plan: what it keeps once compiled (measured in its
    worker) and what its lexer may still add."""
    return kept + config.lexer_bytes


def first_line(message: str) -> str:
    """The first line of an error message from llguidance (its whole text can run long)."""
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"
