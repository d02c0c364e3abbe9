"""`GenerationConfig`: per-call generation settings, with ExecuTorch's names and rules."""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationConfig:
    """Per-call generation settings, as ExecuTorch's ``GenerationConfig``.

    ``max_new_tokens`` and ``seq_len`` use -1 for "unset"; see `resolve_max_new_tokens`.
    ``temperature == 0`` is greedy. ``warming`` marks a warm-up run, as in ExecuTorch: it
    runs like any other (callbacks, position, stats) but its report is logged at debug
    level, not info; `TextLLMRunner.warmup` runs one and then resets the runner.
    """

    echo: bool = True
    max_new_tokens: int = -1
    warming: bool = False
    seq_len: int = -1
    temperature: float = 0.8
    num_bos: int = 0
    num_eos: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < -1 or self.seq_len < -1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} and seq_len={self.seq_len} "
                "must be -1 (unset) or >= 0"
            )
        if self.num_bos < 0 or self.num_eos < 0:
            raise ValueError(f"num_bos={self.num_bos} and num_eos={self.num_eos} must be >= 0")
        self.sampling_params(0)  # validates the sampling fields with their own messages

    def resolve_max_new_tokens(self, max_context_len: int, num_tokens_occupied: int) -> int:
        """How many tokens to generate, given the context size C and the occupied O.

        Both unset: C - O. Only max_new_tokens: min(max_new_tokens, C - O). Only seq_len:
        min(seq_len, C) - O. Both: min(min(seq_len, C) - O, max_new_tokens). Never < 0.
        """
        room = max_context_len - num_tokens_occupied
        if self.seq_len == -1 and self.max_new_tokens == -1:
            result = room
        elif self.seq_len == -1:
            result = min(self.max_new_tokens, room)
        elif self.max_new_tokens == -1:
            result = min(self.seq_len, max_context_len) - num_tokens_occupied
        else:
            result = min(
                min(self.seq_len, max_context_len) - num_tokens_occupied, self.max_new_tokens
            )
        return max(0, result)

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_new_tokens=max_new_tokens,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
        )
