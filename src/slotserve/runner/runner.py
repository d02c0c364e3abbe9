"""`TextLLMRunner`: the single-caller API of ExecuTorch's LLM runner, on the `Engine`.

One caller, one conversation. ``generate`` continues after the conversation so far
(multi-turn), ``generate_from_pos`` places the prompt at an explicit position, ``reset``
starts over, ``stop`` (from any thread) ends the running generation before its next token.
The conversation's tokens live here; each turn is one engine request over them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from slotserve.engine import Engine, EngineConfig, Finished, RequestHandle, TokenEvent
from slotserve.errors import ContextOverflow
from slotserve.model import Model
from slotserve.runner.config import GenerationConfig
from slotserve.runner.result import GenerationResult, Stats, now_ms

TokenCallback = Callable[[str], None]
StatsCallback = Callable[[Stats], None]


class TextLLMRunner:
    """Load a model and generate text for one caller."""

    def __init__(
        self,
        model: str | Path | Model = "bundled",
        *,
        max_context: int | None = None,
        weights: str = "fp32",
    ):
        self._spec = model
        self._weights = weights
        self._model = model if isinstance(model, Model) else None
        self._requested_context = max_context
        self._engine: Engine | None = None
        self._history: list[int] = []  # tokens of the conversation, as fed to the model
        self._pending: list[int] = []  # sampled last turn, fed first by the next generate()
        self._stop = threading.Event()
        self._handle: RequestHandle | None = None
        self.stats = Stats()

    # -- lifecycle -------------------------------------------------------------------

    def load(self) -> None:
        """Load the model (if given by spec) and start a one-slot engine. Idempotent."""
        if self.is_loaded():
            return
        self.stats.model_load_start_ms = now_ms()
        if self._model is None:
            from slotserve.artifact import load

            self._model = load(self._spec, weights=self._weights)  # type: ignore[arg-type]
        info = self._model.info
        context = min(self._requested_context or min(info.max_context, 4096), info.max_context)
        config = EngineConfig(max_seqs=1, max_context=context, kv_layout="flat")
        self._engine = Engine(self._model, config)
        self.stats.model_load_end_ms = now_ms()

    def is_loaded(self) -> bool:
        return self._engine is not None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    @property
    def model(self) -> Model:
        self.load()
        assert self._model is not None
        return self._model

    @property
    def max_context(self) -> int:
        self.load()
        assert self._engine is not None
        return self._engine.config.max_context

    @property
    def position(self) -> int:
        """Positions of the conversation so far."""
        return len(self._history)

    def stop(self) -> None:
        """End the running generation before its next token (thread-safe)."""
        self._stop.set()
        handle = self._handle
        if handle is not None:
            handle.cancel()

    def reset(self) -> None:
        """Forget the conversation; the next ``generate`` starts at position 0."""
        self._history, self._pending = [], []

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        token_callback: TokenCallback | None = None,
        stats_callback: StatsCallback | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` after the conversation so far (the last
        sampled token of the previous turn is fed first)."""
        return self._generate(prompt, self.position, True, config, token_callback, stats_callback)

    def generate_from_pos(
        self,
        prompt: str | Sequence[int],
        start_pos: int,
        config: GenerationConfig | None = None,
        token_callback: TokenCallback | None = None,
        stats_callback: StatsCallback | None = None,
    ) -> GenerationResult:
        """Like `generate`, but the prompt goes exactly at ``start_pos``: the conversation
        before it is kept, from it on replaced."""
        if not 0 <= start_pos <= self.position:
            raise ValueError(
                f"start_pos={start_pos} is outside the conversation (0..{self.position})"
            )
        return self._generate(prompt, start_pos, False, config, token_callback, stats_callback)

    def _generate(
        self,
        prompt: str | Sequence[int],
        start: int,
        feed_pending: bool,
        config: GenerationConfig | None,
        token_callback: TokenCallback | None,
        stats_callback: StatsCallback | None,
    ) -> GenerationResult:
        config = config or GenerationConfig()
        self.load()
        new = [*(self._pending if feed_pending else []), *self._prompt_tokens(prompt, config)]
        if config.warming:
            self._run(self._history[:start], new, replace(config, max_new_tokens=2), None)
        stats = self.stats = Stats(
            model_load_start_ms=self.stats.model_load_start_ms,
            model_load_end_ms=self.stats.model_load_end_ms,
            inference_start_ms=now_ms(),
            token_encode_end_ms=now_ms(),
            num_prompt_tokens=len(new),
        )
        if config.echo and token_callback is not None and isinstance(prompt, str):
            token_callback(prompt)
        result = self._run(self._history[:start], new, config, token_callback)
        self._remember(self._history[:start] + new, result)
        stats.num_generated_tokens = len(result.tokens)
        stats.inference_end_ms = now_ms()
        if stats_callback is not None:
            stats_callback(stats)
        return replace(result, stats=stats)

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
        kept: list[int],
        new: list[int],
        config: GenerationConfig,
        token_callback: TokenCallback | None,
    ) -> GenerationResult:
        """One engine request over the conversation; streams until done or stopped."""
        tokens = kept + new
        if not new:
            raise ValueError("the prompt is empty and the conversation has nothing to continue")
        if len(tokens) > self.max_context:
            raise ContextOverflow(len(tokens), self.max_context, "shorten the prompt or reset()")
        max_new = config.resolve_max_new_tokens(self.max_context, len(tokens))
        assert self._engine is not None
        self._stop.clear()
        handle = self._handle = self._engine.submit(tokens, config.sampling_params(max_new))
        try:
            return self._consume(handle, token_callback)
        finally:
            self._handle = None

    def _consume(
        self, handle: RequestHandle, token_callback: TokenCallback | None
    ) -> GenerationResult:
        out: list[int] = []
        text: list[str] = []
        for event in handle:
            if self._stop.is_set():
                handle.cancel(wait=True)
                return GenerationResult(out, "".join(text), "cancelled", eos_token=None)
            if isinstance(event, TokenEvent):
                if event.token_id >= 0:
                    out.append(event.token_id)
                if event.text:
                    text.append(event.text)
                    if token_callback is not None:
                        token_callback(event.text)
            elif isinstance(event, Finished):
                self._prefill_done(event)
                return GenerationResult(out, "".join(text), event.reason, event.eos_token)
        raise AssertionError("the stream ended without a Finished event")

    def _prefill_done(self, finished: Finished) -> None:
        # The engine's clock is time.monotonic (seconds), the one now_ms reads in ms.
        timings = finished.timings
        if timings.prefill_done is not None:
            self.stats.prompt_eval_end_ms = int(timings.prefill_done * 1000)
        if timings.token_times:
            self.stats.first_token_ms = int(timings.token_times[0] * 1000)

    def _remember(self, prompt: list[int], result: GenerationResult) -> None:
        """The conversation now holds the prompt and the generated tokens; the last
        sampled token (or the EOS that ended the turn) is fed by the next generate()."""
        sampled = [*result.tokens, *([result.eos_token] if result.eos_token is not None else [])]
        if result.finish_reason == "cancelled" or not sampled:
            self._history, self._pending = prompt + sampled, []
        else:
            self._history, self._pending = prompt + sampled[:-1], sampled[-1:]
