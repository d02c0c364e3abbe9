"""`SamplingParams`: how one request picks its tokens, validated when it is made.

Owns the parameters and their ranges only; the sampler (`sampler.py`) applies them and the
grammar (`grammar.py`) is carried here as an opaque, already compiled value.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.sampling.grammar import Grammar

MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy.

    ``seed`` makes sampling reproducible per request (the same seed gives the same tokens
    whatever else is running). ``stop`` strings end generation and are never emitted.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's and the top k
    # (token id, bias) pairs added to the logits, as OpenAI's logit_bias (-100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only tokens this grammar allows next may be drawn (structured outputs).
    grammar: Grammar | None = None
    # llama.cpp's samplers (`chain`); each default leaves it off.
    typical_p: float = 1.0  # locally typical sampling; 1: off
    top_n_sigma: float = -1.0  # keep logits within n deviations of the top; <= 0: off
    xtc_probability: float = 0.0  # exclude top choices: how often; 0: off
    xtc_threshold: float = 0.1  # ... and from what probability (> 0.5: off)
    dry_multiplier: float = 0.0  # DRY repetition penalty; 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # tokens of the history looked at; -1: all, 0: off
    # DRY's sequence breakers as token sequences, head first (`chain.breaker_sequences`).
    dry_breakers: tuple[tuple[int, ...], ...] = ()
    mirostat: int = 0  # 1 or 2: mirostat replaces top-k/top-p/min-p/typical/XTC/top-n-sigma
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # vLLM's min_tokens: ``min_tokens_ids`` (the model's end-of-sequence tokens, which
    # whoever builds the params supplies) cannot be drawn before that many tokens.
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()
    # Whether the engine may verify drafted tokens for this request (where it speculates);
    # the output is the same either way, only the number of steps changes.
    speculate: bool = True

    def __post_init__(self) -> None:
        _check(0.0 <= self.temperature <= 100.0, "temperature", self.temperature, "0..100")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 disables)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "-2..2"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "-2..2",
        )
        _check(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", self.logprobs, "0..20")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", self.seed, "a 64-bit integer")
        if isinstance(self.stop, str) or any(not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        for token, bias in self.logit_bias:
            _check(token >= 0, "logit_bias token id", token, ">= 0")
            _check(-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias", bias, "-100..100")
        _check(0.0 < self.typical_p <= 1.0, "typical_p", self.typical_p, "(0, 1]")
        _check(self.top_n_sigma <= 100.0, "top_n_sigma", self.top_n_sigma, "<= 100 (<= 0: off)")
        _check(
            0.0 <= self.xtc_probability <= 1.0, "xtc_probability", self.xtc_probability, "[0, 1]"
        )
        _check(0.0 <= self.xtc_threshold <= 1.0, "xtc_threshold", self.xtc_threshold, "[0, 1]")
        _check(
            0.0 <= self.dry_multiplier <= 100.0, "dry_multiplier", self.dry_multiplier, "[0, 100]"
        )
        _check(1.0 <= self.dry_base <= 100.0, "dry_base", self.dry_base, "[1, 100]")
        _check(self.dry_allowed_length >= 0, "dry_allowed_length", self.dry_allowed_length, ">= 0")
        _check(
            self.dry_penalty_last_n >= -1, "dry_penalty_last_n", self.dry_penalty_last_n, ">= -1"
        )
        _check(self.mirostat in (0, 1, 2), "mirostat", self.mirostat, "0 (off), 1 or 2")
        _check(0.0 <= self.mirostat_tau <= 100.0, "mirostat_tau", self.mirostat_tau, "[0, 100]")
        _check(0.0 <= self.mirostat_eta <= 10.0, "mirostat_eta", self.mirostat_eta, "[0, 10]")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        _check(
            self.min_tokens <= self.max_new_tokens,
            "min_tokens",
            self.min_tokens,
            f"<= max_new_tokens ({self.max_new_tokens})",
        )

    @property
    def greedy(self) -> bool:
        # Temperatures this small make every distribution one-hot (and overflow the
        # division), so they are greedy.
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def dry(self) -> bool:
        """Whether DRY is on (llama.cpp's rule: a multiplier and a window)."""
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


# The settings whose draw allocates the most a row: no top-k (the whole vocabulary sorted
# for top-p), a repetition penalty (a copy of the row) and log-probabilities. The memory
# plan's activations hold one such draw; `slotserve.load` runs one so the first request's
# sampling finds its one-time state (torch's sort and multinomial code) already paid.
COSTLIEST_SAMPLING = SamplingParams(top_p=0.9, repetition_penalty=1.1, logprobs=20)
