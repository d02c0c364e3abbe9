"""`TextLLMRunner`: the single-caller API of ExecuTorch's LLM runner, on the `Engine`.

One caller, one conversation. ``generate`` continues after the conversation so far
(multi-turn), ``prefill`` adds a prompt to it without generating (a chat history rebuilt),
``generate_from_pos`` places the prompt at an explicit position, ``reset`` starts over,
``stop`` (from any thread) ends the running generation before its next token.
docs/RUNNER.md sets each beside ExecuTorch 1.5.1's runner, row by row, with its test.

The conversation's tokens live here; each turn is one engine request over them. Where a
restored prefix is bit-exact (`slotserve.runner.caching`: `slotserve serve`'s rule, logged
at load with the reason), the engine keeps the conversation's KV between turns: its one
slot runs the cell layout with a prefix cache, each turn hands its prompt and completion to
the cache when it ends, and the next turn restores them, so it computes only its new tokens
(plus the last prompt token, when the whole prompt was cached: logits are never stored).
Sliding-window layers keep only their last window, which still serves a turn that continues
the conversation (the cache's retention rule refuses a restore they could not serve).
Elsewhere (a bundle, dense or int8 weights) every turn computes the whole conversation;
``prefix_cache=True`` keeps the KV anyway, ``prefix_cache=False`` never. ``prefix_store``
(a directory) gives that cache its disk tier (`slotserve.prefix.store`, at most
``prefix_store_bytes``), as ``EngineConfig`` does: each turn's snapshot is written there in
the background (closing waits for the writes), and a runner started later on the same
model, context and directory resumes the conversation from disk: given the conversation's
tokens (`conversation`, saved by the caller) and the next message, it restores them instead
of computing them.
`Stats` keeps ExecuTorch's meanings (``num_prompt_tokens``: the tokens this call adds);
``prompt_tokens_computed`` and ``prompt_tokens_restored`` say what the engine did, and the
model-execution fields time the forward passes (`slotserve.runner.timing`).

Where ExecuTorch's ``TextLLMRunner`` (extension/llm/runner/text_llm_runner.cpp) defines a
behaviour, this one follows it: the refusals of a prompt that leaves no room to generate,
``prefill`` and an empty prompt after it, ``GenerationConfig.warming`` (a warm-up run: its
report is logged at debug level, not info), ``warmup`` (a warm-up run, then ``reset``) and
`Stats`. Where it differs (the last sampled token of a turn is fed to the next, not
dropped; every token is sampled with the config's settings), docs/RUNNER.md says so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from slotserve.engine import Engine, EngineConfig, Finished, RequestHandle, TokenEvent
from slotserve.engine.config import DEFAULT_PREFIX_STORE_BYTES, SpeculateMode
from slotserve.engine.timings import RequestTimings
from slotserve.errors import ContextOverflow
from slotserve.model import Model
from slotserve.runner.caching import CacheChoice, choose_prefix_cache
from slotserve.runner.config import GenerationConfig
from slotserve.runner.result import GenerationResult, Stats, now_ms
from slotserve.runner.timing import TimedExecutor
from slotserve.sampling import SamplingParams

log = logging.getLogger("slotserve.runner")

TokenCallback = Callable[[str], None]
StatsCallback = Callable[[Stats], None]

# What `prefill` samples after the prompt: the greedy next token, as ExecuTorch's prefill
# takes it (an EOS too: it is the prediction, whether or not a generation ends there).
PREDICT = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)


class TextLLMRunner:
    """Load a model and generate text for one caller. ``prefix_cache``: None (default) keeps
    the conversation's KV between turns where restoring it is bit-exact, True anyway, False
    never. ``prefix_store`` (with the cache on): the directory of its disk tier, at most
    ``prefix_store_bytes`` (bytes or ``"4GiB"``); see the module docstring. ``speculate``
    (``"ngram"``): drafted tokens verified in one step, the output the same bit for bit
    (`EngineConfig.speculate`; where the model's logits could depend on the chunking, the
    engine does not draft and logs why); ``"draft"``: ``draft_model`` drafts (a spec, its
    weights held as ``draft_weights``, or a loaded `Model`; `slotserve.engine.draft`)."""

    def __init__(
        self,
        model: str | Path | Model = "bundled",
        *,
        max_context: int | None = None,
        weights: str = "auto",
        prefix_cache: bool | None = None,
        prefix_store: str | Path | None = None,
        prefix_store_bytes: int | str = DEFAULT_PREFIX_STORE_BYTES,
        speculate: SpeculateMode = "off",
        draft_model: str | Path | Model | None = None,
        draft_weights: str = "auto",
    ):
        if prefix_store is not None and prefix_cache is False:
            raise ValueError(
                f"prefix_store={str(prefix_store)!r} is the conversation cache's disk tier "
                "and needs prefix_cache=True; turn the cache on, or leave prefix_store off"
            )
        self._spec = model
        self._prefix_cache = prefix_cache
        self._prefix_store = prefix_store
        self._prefix_store_bytes = prefix_store_bytes
        self._weights = weights
        self._speculate = speculate
        self._draft_model = draft_model
        self._draft_weights = draft_weights
        self._model = model if isinstance(model, Model) else None
        self._requested_context = max_context
        self._engine: Engine | None = None
        self._executor: TimedExecutor | None = None
        self._cache_choice: CacheChoice | None = None
        self._history: list[int] = []  # tokens of the conversation, as fed to the model
        # Fed first by the next generate(): the last sampled token, shown to the caller; or,
        # after prefill(), the token the model predicts next, not shown yet (`_predicted`).
        self._pending: list[int] = []
        self._predicted = False
        self._stop = threading.Event()
        self._handle: RequestHandle | None = None
        self.stats = Stats()

    # -- lifecycle -------------------------------------------------------------------

    def load(self) -> None:
        """Load the model (if given by spec) and start a one-slot engine. Idempotent. Logs
        whether the prefix cache is on and why (`prefix_cache_choice`)."""
        if self.is_loaded():
            return
        self.stats.model_load_start_ms = now_ms()
        if self._model is None:
            from slotserve.artifact import load

            self._model = load(self._spec, weights=self._weights)  # type: ignore[arg-type]
        model = self._model
        info = model.info
        context = min(self._requested_context or min(info.max_context, 4096), info.max_context)
        draft = self._draft_model
        config = EngineConfig(
            max_seqs=1,
            max_context=context,
            kv_layout="flat",
            speculate=self._speculate,
            draft_model=None if draft is None or isinstance(draft, Model) else draft,
            draft_weights=self._draft_weights,
        )
        choice = self._cache_choice = choose_prefix_cache(model, config, self._prefix_cache)
        log.info("%s", choice.describe("prefix_cache=True", "prefix_cache=False"))
        if choice.on:
            config = _caching(config, model)
        if self._prefix_store is not None:
            if not choice.on:
                raise ValueError(
                    f"prefix_store={str(self._prefix_store)!r} is the conversation cache's "
                    f"disk tier, and the cache is off: {choice.inexact}; pass "
                    "prefix_cache=True to keep it anyway, or leave prefix_store off"
                )
            config = replace(
                config,
                prefix_store=self._prefix_store,
                prefix_store_bytes=self._prefix_store_bytes,
            )
        self._executor = TimedExecutor(model)
        self._engine = Engine(
            model,
            config,
            executor=self._executor,
            draft=draft if isinstance(draft, Model) else None,
        )
        self.stats.model_load_end_ms = now_ms()

    def is_loaded(self) -> bool:
        """Whether the model is loaded and its engine running (`load`, or the first
        `generate` or `prefill`); False again after `close`."""
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
    def prefix_cache_choice(self) -> CacheChoice | None:
        """Whether the prefix cache is on, as asked and on this model (None before
        `load`)."""
        return self._cache_choice

    def get_vocab_size(self) -> int:
        """The model's vocabulary size: the rows of its logits (loads the model).
        ExecuTorch 1.5.1's Python runner returns -1 here (not available)."""
        return self.model.info.vocab_size

    @property
    def position(self) -> int:
        """Positions of the conversation so far."""
        return len(self._history)

    @property
    def conversation(self) -> list[int]:
        """The conversation's tokens: its positions, then the last sampled token that the
        next `generate` feeds first (not a token `prefill` predicted: never shown, it is
        not the conversation's). A runner started later (with the same ``prefix_store``)
        continues it with ``generate([*conversation, *message])``, restoring it from disk."""
        return [*self._history, *([] if self._predicted else self._pending)]

    def stop(self) -> None:
        """End the running generation before its next token (thread-safe)."""
        self._stop.set()
        handle = self._handle
        if handle is not None:
            handle.cancel()

    def reset(self) -> None:
        """Forget the conversation, a prefilled prediction and the stats (all but the model
        load times, as ExecuTorch's ``Stats::reset()``); the next ``generate`` starts at
        position 0."""
        self._history, self._pending, self._predicted = [], [], False
        self.stats = self._fresh_stats()

    def warmup(self, prompt: str | Sequence[int], max_new_tokens: int) -> None:
        """Run one warm-up generation of ``prompt``, then `reset` (ExecuTorch's
        ``TextLLMRunner::warmup``): nothing of it stays in the conversation or the stats."""
        config = GenerationConfig(echo=False, max_new_tokens=max_new_tokens, warming=True)
        try:
            self.generate(prompt, config)
        finally:
            self.reset()

    # -- generation ------------------------------------------------------------------

    def prefill(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> None:
        """Add ``prompt`` to the conversation without generating: ExecuTorch's
        ``TextLLMRunner.prefill`` (a chat history rebuilt before `generate`). Encoded with
        ``config``'s ``num_bos`` and ``num_eos`` (its other fields are not read), placed
        after the conversation so far (the last reply's token fed first, as `generate`
        feeds it) and computed. The token the model predicts next (greedy, as ExecuTorch's
        prefill takes it) is kept: a `generate` with an empty prompt starts from it, one
        with a prompt drops it; another prefill drops it too, so successive prefills add up
        to one history. The stats are left alone (ExecuTorch's prefill reports none)."""
        config = config or GenerationConfig()
        self.load()
        if _is_empty(prompt):
            raise ValueError(
                "prefill needs a prompt: an empty one adds nothing to the conversation"
            )
        feed = [] if self._predicted else self._pending
        new = [*feed, *self._prompt_tokens(prompt, config)]
        kept = self._history
        self._check_room(len(kept), len(new))
        result, _ = self._run(kept + new, PREDICT, None, None)
        self._history = kept + new
        predicted = result.tokens[:1] if result.finish_reason != "cancelled" else []
        self._pending, self._predicted = predicted, bool(predicted)

    def generate(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        token_callback: TokenCallback | None = None,
        stats_callback: StatsCallback | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` after the conversation so far (the last
        sampled token of the previous turn is fed first). An empty prompt after `prefill`
        starts from the token prefill predicted, the first generated token (ExecuTorch's
        rule); an empty prompt after a generation continues its reply."""
        return self._generate(prompt, None, config, token_callback, stats_callback)

    def generate_from_pos(
        self,
        prompt: str | Sequence[int],
        start_pos: int,
        config: GenerationConfig | None = None,
        token_callback: TokenCallback | None = None,
        stats_callback: StatsCallback | None = None,
    ) -> GenerationResult:
        """Like `generate`, but the prompt goes exactly at ``start_pos``: the conversation
        before it is kept, from it on replaced (no pending token is fed)."""
        if not 0 <= start_pos <= self.position:
            raise ValueError(
                f"start_pos={start_pos} is outside the conversation (0..{self.position})"
            )
        return self._generate(prompt, start_pos, config, token_callback, stats_callback)

    def _generate(
        self,
        prompt: str | Sequence[int],
        start: int | None,
        config: GenerationConfig | None,
        token_callback: TokenCallback | None,
        stats_callback: StatsCallback | None,
    ) -> GenerationResult:
        """One turn: ``start`` None continues the conversation, else replaces it from
        ``start``."""
        config = config or GenerationConfig()
        self.load()
        stats = self.stats = self._fresh_stats()
        stats.inference_start_ms = now_ms()  # before encoding, as ExecuTorch's runner
        if start is None and self._predicted and _is_empty(prompt):
            return self._generate_from_prediction(config, token_callback, stats_callback)
        feed = self._pending if start is None and not self._predicted else []
        new = [*feed, *self._prompt_tokens(prompt, config)]
        stats.token_encode_end_ms = now_ms()
        stats.num_prompt_tokens = len(new)
        kept = self._history[: self.position if start is None else start]
        if not new:
            raise ValueError("the prompt is empty and the conversation has nothing to continue")
        max_new = self._resolve_max_new_tokens(config, len(kept), len(new))
        if config.echo and token_callback is not None and isinstance(prompt, str):
            token_callback(prompt)
        result, timings = self._run(
            kept + new, config.sampling_params(max_new), token_callback, stats
        )
        stats.record_engine_timings(timings)
        self._remember(kept + new, result)
        return self._finish(stats, result, config.warming, stats_callback)

    def _generate_from_prediction(
        self,
        config: GenerationConfig,
        token_callback: TokenCallback | None,
        stats_callback: StatsCallback | None,
    ) -> GenerationResult:
        """An empty prompt after `prefill`: the predicted token is the first generated one
        (shown at once, as ExecuTorch shows its prefill's token), then the engine decodes
        from it. The prompt tokens are the conversation's positions (ExecuTorch: ``pos_``).
        A predicted EOS ends the turn there, as a sampled one does (unless ``ignore_eos``)."""
        stats, tokenizer = self.stats, self.model.tokenizer
        kept, (token,) = self._history, self._pending
        stats.token_encode_end_ms = now_ms()  # nothing to encode
        stats.num_prompt_tokens = len(kept)
        max_new = self._resolve_max_new_tokens(config, len(kept), 0)
        stats.prompt_eval_end_ms = stats.first_token_ms = now_ms()
        self._predicted = False  # shown from here on: fed by the next turn like any token
        if token in tokenizer.eos_ids and not config.ignore_eos:
            first = GenerationResult([], "", "stop", eos_token=token)
            return self._finish(stats, first, config.warming, stats_callback)
        text = tokenizer.decode([token], skip_special=True)
        if text and token_callback is not None:
            token_callback(text)
        if max_new == 1:
            first = GenerationResult([token], text, "length")
            return self._finish(stats, first, config.warming, stats_callback)
        rest, timings = self._run(
            [*kept, token], config.sampling_params(max_new - 1), token_callback, stats
        )
        stats.record_engine_timings(timings, first_token=False)
        self._remember([*kept, token], rest)
        result = replace(rest, tokens=[token, *rest.tokens], text=text + rest.text)
        return self._finish(stats, result, config.warming, stats_callback)

    def _finish(
        self,
        stats: Stats,
        result: GenerationResult,
        warming: bool,
        stats_callback: StatsCallback | None,
    ) -> GenerationResult:
        """Count the decode steps' tokens, end the inference span, report."""
        stats.num_generated_tokens = _decode_step_tokens(result)
        stats.inference_end_ms = now_ms()
        self._report(stats, warming)
        if stats_callback is not None:
            stats_callback(stats)
        return replace(result, stats=stats)

    def _fresh_stats(self) -> Stats:
        """Zeroed stats that keep the model load times."""
        return Stats(
            model_load_start_ms=self.stats.model_load_start_ms,
            model_load_end_ms=self.stats.model_load_end_ms,
        )

    def _check_room(self, kept: int, new: int) -> None:
        """ExecuTorch's rule: the conversation plus the prompt must leave a free position
        (``pos + prompt < max_context``), or `ContextOverflow` names both and the limit."""
        context, occupied = self.max_context, kept + new
        if occupied >= context:
            raise ContextOverflow(
                occupied + 1,
                context,
                f"the conversation holds {kept} positions and the prompt {new} tokens, "
                f"leaving none of max_context={context} to generate into; "
                "shorten the prompt or reset()",
            )

    def _resolve_max_new_tokens(self, config: GenerationConfig, kept: int, new: int) -> int:
        """How many tokens this turn may generate, or the error ExecuTorch's runner gives:
        the conversation plus the prompt must leave a free position (`_check_room`), and
        the resolved budget must be > 0. Checked before anything runs (ExecuTorch checks
        the budget after prefill), so a refusal changes nothing."""
        self._check_room(kept, new)
        occupied = kept + new
        max_new = config.resolve_max_new_tokens(self.max_context, occupied)
        if max_new > 0:
            return max_new
        if config.max_new_tokens == 0:
            raise ValueError("max_new_tokens=0: a generation must be allowed at least 1 token")
        limit = min(config.seq_len, self.max_context)
        raise ContextOverflow(
            occupied + 1,
            limit,
            f"seq_len={config.seq_len} leaves no room after {occupied} positions "
            f"(conversation {kept} + prompt {new}); raise seq_len or reset()",
        )

    def _report(self, stats: Stats, warming: bool) -> None:
        # ExecuTorch prints its report only for a run that is not a warm-up one; a warm-up
        # run logs at debug level instead of info.
        log.log(logging.DEBUG if warming else logging.INFO, "PyTorchObserver %s", stats.to_json())

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
        tokens: list[int],
        params: SamplingParams,
        token_callback: TokenCallback | None,
        timing: Stats | None,
    ) -> tuple[GenerationResult, RequestTimings]:
        """One engine request over the conversation; streams until done or stopped. Its
        forward passes are timed into ``timing`` (None: not timed)."""
        assert self._engine is not None and self._executor is not None
        self._stop.clear()
        self._executor.timing = timing
        try:
            handle = self._handle = self._engine.submit(tokens, params, publish_completion=True)
            try:
                return self._consume(handle, token_callback)
            except BaseException:
                # A callback raised (or Ctrl-C): stop the request and release its slot
                # before the exception leaves, or the next generate() is refused with
                # slots_full.
                handle.cancel(wait=True)
                raise
        finally:
            self._handle = None
            self._executor.timing = None  # the request was released: no step of it runs

    def _consume(
        self, handle: RequestHandle, token_callback: TokenCallback | None
    ) -> tuple[GenerationResult, RequestTimings]:
        out: list[int] = []
        text: list[str] = []
        for event in handle:
            if self._stop.is_set():
                handle.cancel(wait=True)
                # Released, so its Finished (with the engine's timings) is already queued.
                stopped = GenerationResult(out, "".join(text), "cancelled", eos_token=None)
                return stopped, handle.result().timings
            if isinstance(event, TokenEvent):
                if event.token_id >= 0:
                    out.append(event.token_id)
                if event.text:
                    text.append(event.text)
                    if token_callback is not None:
                        token_callback(event.text)
            elif isinstance(event, Finished):
                result = GenerationResult(out, "".join(text), event.reason, event.eos_token)
                return result, event.timings
        raise AssertionError("the stream ended without a Finished event")

    def _remember(self, prompt: list[int], result: GenerationResult) -> None:
        """The conversation now holds the prompt and the generated tokens; the last
        sampled token (or the EOS that ended the turn) is fed by the next generate()."""
        sampled = [*result.tokens, *([result.eos_token] if result.eos_token is not None else [])]
        self._predicted = False
        if result.finish_reason == "cancelled" or not sampled:
            self._history, self._pending = prompt + sampled, []
        else:
            self._history, self._pending = prompt + sampled[:-1], sampled[-1:]


def common_prefix(held: list[int], tokens: list[int], limit: int) -> int:
    """Length of the common prefix of ``held[:limit]`` and ``tokens``, leaving at least one
    token of ``tokens`` to feed (how `slotserve chat` places a turn's tokens with
    `TextLLMRunner.generate_from_pos`)."""
    n = 0
    for a, b in zip(held[:limit], tokens, strict=False):
        if a != b:
            break
        n += 1
    return min(n, len(tokens) - 1)


def _caching(config: EngineConfig, model: Model) -> EngineConfig:
    """``config`` with the cell layout and a prefix cache that may pin the whole pool (one
    conversation: its blocks, and a copy of its sliding-window rings if the model has
    any)."""
    block_size = next(b for b in (16, 8, 4, 2, 1) if config.max_context % b == 0)
    cell = replace(config, kv_layout="cell", block_size=block_size)
    pool_bytes = cell.kv_bytes(model.info)
    return replace(cell, prefix_cache_bytes=pool_bytes)


def _decode_step_tokens(result: GenerationResult) -> int:
    """ExecuTorch's ``num_generated_tokens``: the sampled tokens (an EOS that ended the turn
    included) less the first, which prefill produced."""
    sampled = len(result.tokens) + (result.eos_token is not None)
    return max(0, sampled - 1)


def _is_empty(prompt: str | Sequence[int]) -> bool:
    """An empty prompt, before encoding (ExecuTorch checks the string, not its tokens)."""
    return len(prompt) == 0
