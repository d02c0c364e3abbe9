"""What one generation reports: `Stats` (ExecuTorch's runner stats) and `GenerationResult`."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar


def now_ms() -> int:
    """Milliseconds on a monotonic clock (differences are meaningful, not the origin)."""
    return time.monotonic_ns() // 1_000_000


@dataclass
class Stats:
    """Timestamps (ms, monotonic) and counts of one generation, as ExecuTorch's runner."""

    SCALING_FACTOR_UNITS_PER_SECOND: ClassVar[int] = 1000
    model_load_start_ms: int = 0
    model_load_end_ms: int = 0
    inference_start_ms: int = 0
    token_encode_end_ms: int = 0
    prompt_eval_end_ms: int = 0
    first_token_ms: int = 0
    inference_end_ms: int = 0
    aggregate_sampling_time_ms: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        span = self.prompt_eval_end_ms - self.inference_start_ms
        return self.num_prompt_tokens * 1000 / span if span > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the first."""
        span = self.inference_end_ms - self.first_token_ms
        n = self.num_generated_tokens - 1
        return n * 1000 / span if span > 0 and n > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        data: dict[str, float | int] = asdict(self)
        data["SCALING_FACTOR_UNITS_PER_SECOND"] = self.SCALING_FACTOR_UNITS_PER_SECOND
        return data

    def to_json(self) -> str:
        """The stats as one JSON object (ExecuTorch's field names)."""
        return json.dumps(self.to_dict())


@dataclass(frozen=True)
class GenerationResult:
    """What a generation produced: token ids (EOS excluded), text, why it ended
    (stop, length, cancelled), the EOS token that ended it if any, and stats."""

    tokens: list[int]
    text: str
    finish_reason: str
    eos_token: int | None = None
    stats: Stats = field(default_factory=Stats)
