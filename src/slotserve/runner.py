"""`TextLLMRunner`: the single-caller API of ExecuTorch's LLM runner, on slotserve.

One caller, one conversation, one KV slot. ``generate`` continues from the runner's
current position (multi-turn), ``generate_from_pos`` from an explicit one, ``reset``
starts over, ``stop`` (from any thread) ends the running generation before its next token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from slotserve.errors import ContextOverflow
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import KVConfig
from slotserve.kv.pool import KVPool
from slotserve.model import Model
from slotserve.runner_types import GenerationConfig, GenerationResult, Stats, now_ms
from slotserve.sampling import RequestSampler, StopMatcher

TokenCallback = Callable[[str], None]
StatsCallback = Callable[[Stats], None]


SESSION = 0  # the runner's one KV session


class TextLLMRunner:
    """Load a model and generate text for one caller."""

    def __init__(self, model: str | Path | Model = "bundled", *, max_context: int | None = None):
        self._spec = model
        self._model = model if isinstance(model, Model) else None
        self._requested_context = max_context
        self._kv: KVPool | None = None
        # A token sampled at the end of the last turn but not yet fed back: the next
        # generate() prepends it.
        self._pending: list[int] = []
        self._stop = threading.Event()
        self.stats = Stats()

    # -- lifecycle -------------------------------------------------------------------

    def load(self) -> None:
        """Load the model (if given by spec) and allocate the KV slot. Idempotent."""
        if self.is_loaded():
            return
        self.stats.model_load_start_ms = now_ms()
        if self._model is None:
            from slotserve.artifact import load

            self._model = load(self._spec)  # type: ignore[arg-type]
        info = self._model.info
        context = min(self._requested_context or min(info.max_context, 4096), info.max_context)
        self._kv = KVPool(info, KVConfig(layout="flat", max_seqs=1, max_context=context))
        self._kv.reserve(SESSION, context)
        self.stats.model_load_end_ms = now_ms()

    def is_loaded(self) -> bool:
        return self._model is not None and self._kv is not None

    @property
    def model(self) -> Model:
        self.load()
        assert self._model is not None
        return self._model

    @property
    def max_context(self) -> int:
        self.load()
        assert self._kv is not None
        return self._kv.config.max_context

    @property
    def position(self) -> int:
        """Positions of the conversation already in the KV slot."""
        return self._kv.length(SESSION) if self._kv is not None else 0

    def stop(self) -> None:
        """Ask the running generation to end before its next token (thread-safe)."""
        self._stop.set()

    def reset(self) -> None:
        """Forget the conversation; the next ``generate`` starts at position 0."""
        self._rewind_to(0)
        self._pending = []

    def _rewind_to(self, position: int) -> None:
        if self._kv is not None:
            self._kv.rewind(SESSION, self._kv.length(SESSION) - position)

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        token_callback: TokenCallback | None = None,
        stats_callback: StatsCallback | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` after what the conversation already holds
        (the last sampled token of the previous turn is fed first)."""
        config = config or GenerationConfig()
        self.load()
        start, prefix = self.position, list(self._pending)
        if config.warming:
            self._warm_up(prompt, start, prefix, config)
        return self._run(prompt, start, prefix, config, token_callback, stats_callback)

    def generate_from_pos(
        self,
        prompt: str | Sequence[int],
        start_pos: int,
        config: GenerationConfig | None = None,
        token_callback: TokenCallback | None = None,
        stats_callback: StatsCallback | None = None,
    ) -> GenerationResult:
        """Like `generate`, but the prompt goes exactly at ``start_pos``: positions before it
        are kept from the conversation, positions from it on are replaced."""
        config = config or GenerationConfig()
        self.load()
        if not 0 <= start_pos <= self.position:
            raise ValueError(
                f"start_pos={start_pos} is outside the conversation (0..{self.position})"
            )
        if config.warming:
            self._warm_up(prompt, start_pos, [], config)
        return self._run(prompt, start_pos, [], config, token_callback, stats_callback)

    def _warm_up(
        self,
        prompt: str | Sequence[int],
        start_pos: int,
        prefix: list[int],
        config: GenerationConfig,
    ) -> None:
        """Run the prompt once (2 tokens) to warm kernels and caches, then forget it."""
        saved_pending = list(self._pending)
        cold = replace(config, warming=False, echo=False, max_new_tokens=2)
        self._run(prompt, start_pos, prefix, cold, None, None)
        self._rewind_to(start_pos)
        self._pending = saved_pending

    def _prompt_tokens(self, prompt: str | Sequence[int], config: GenerationConfig) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        tokenizer = self.model.tokenizer
        ids = tokenizer.encode(prompt, add_bos=False)
        bos = [tokenizer.bos_id] * config.num_bos if tokenizer.bos_id is not None else []
        eos = [tokenizer.eos_ids[0]] * config.num_eos if tokenizer.eos_ids else []
        return [*bos, *ids, *eos]

    def _run(
        self,
        prompt: str | Sequence[int],
        start: int,
        prefix: list[int],
        config: GenerationConfig,
        token_callback: TokenCallback | None,
        stats_callback: StatsCallback | None,
    ) -> GenerationResult:
        stats = self.stats = Stats(
            model_load_start_ms=self.stats.model_load_start_ms,
            model_load_end_ms=self.stats.model_load_end_ms,
            inference_start_ms=now_ms(),
        )
        self._stop.clear()
        tokens = [*prefix, *self._prompt_tokens(prompt, config)]
        if not tokens:
            raise ValueError("the prompt is empty and the conversation has nothing to continue")
        occupied = start + len(tokens)
        if occupied > self.max_context:
            raise ContextOverflow(occupied, self.max_context, "shorten the prompt or reset()")
        max_new = config.resolve_max_new_tokens(self.max_context, occupied)
        stats.token_encode_end_ms = now_ms()
        stats.num_prompt_tokens = len(tokens)
        if config.echo and token_callback is not None and isinstance(prompt, str):
            token_callback(prompt)
        result = self._generate_tokens(tokens, start, max_new, config, token_callback)
        stats.inference_end_ms = now_ms()
        stats.num_generated_tokens = len(result.tokens)
        if stats_callback is not None:
            stats_callback(stats)
        return replace(result, stats=stats)

    def _generate_tokens(
        self,
        prompt: list[int],
        start: int,
        max_new: int,
        config: GenerationConfig,
        token_callback: TokenCallback | None,
    ) -> GenerationResult:
        model, kv, stats = self.model, self._kv, self.stats
        assert kv is not None
        params = config.sampling_params(max_new)
        sampler = RequestSampler(params, model.info.vocab_size, prompt)
        decoder = model.tokenizer.stream_decoder()
        stops = StopMatcher(params.stop)
        eos = set() if params.ignore_eos else set(model.tokenizer.eos_ids)
        self._rewind_to(start)
        self._pending = []
        logits = model.prefill(torch.tensor(prompt), StepBatch.single(start, len(prompt)), kv)
        position = start + len(prompt)
        stats.prompt_eval_end_ms = now_ms()
        out: list[int] = []
        text: list[str] = []
        reason = "length"
        while len(out) < max_new:
            if self._stop.is_set():
                reason = "cancelled"
                break
            sample_start = now_ms()
            token = sampler.sample(logits[0])
            sampler.accept(token)
            stats.aggregate_sampling_time_ms += now_ms() - sample_start
            if not out:
                stats.first_token_ms = now_ms()
            self._pending = [token]
            if token in eos:
                reason = "stop"
                break
            out.append(token)
            piece, stopped = stops.push(decoder.push(token))
            _emit(piece, text, token_callback)
            if stopped:
                reason = "stop"
                break
            if len(out) == max_new:
                break
            logits = model.decode(torch.tensor([token]), StepBatch.single(position, 1), kv)
            self._pending = []
            position += 1
        if not stops.stopped:
            _emit(stops.push(decoder.flush())[0] + stops.flush(), text, token_callback)
        return GenerationResult(tokens=out, text="".join(text), finish_reason=reason, stats=stats)


def _emit(piece: str, text: list[str], token_callback: TokenCallback | None) -> None:
    if piece:
        text.append(piece)
        if token_callback is not None:
            token_callback(piece)
