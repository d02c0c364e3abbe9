"""`TextLLMRunner` against ExecuTorch 1.5.1's runner, row by row (issue 52, item 5): each
test here is one row of the table in docs/RUNNER.md (the rows that older tests cover name
them there). ExecuTorch's behaviour is read from its ``text_llm_runner.cpp``,
``text_token_generator.h`` and Python binding, as shipped in 1.5."""

from __future__ import annotations

from pathlib import Path

import pytest

import slotserve as ss
from slotserve.runner import GenerationConfig

GREEDY = GenerationConfig(echo=False, temperature=0, max_new_tokens=6, ignore_eos=True)


def one_shot(model: ss.Model, tokens: list[int], config: GenerationConfig = GREEDY) -> list[int]:
    """The tokens a fresh runner generates after ``tokens``, fed as one prompt."""
    runner = ss.TextLLMRunner(model, max_context=64, prefix_cache=False)
    try:
        return runner.generate(tokens, config).tokens
    finally:
        runner.close()


# Row: loading ---------------------------------------------------------------------------


@pytest.mark.parametrize("first_call", ["load", "generate", "prefill", "get_vocab_size"])
def test_is_loaded_follows_load_and_close(tiny: ss.Model, first_call: str) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    assert not runner.is_loaded()
    if first_call == "load":
        runner.load()
    elif first_call == "generate":
        runner.generate([5, 6], GREEDY)
    elif first_call == "prefill":
        runner.prefill([5, 6])
    else:
        runner.get_vocab_size()
    assert runner.is_loaded()
    assert runner.stats.model_load_end_ms >= runner.stats.model_load_start_ms > 0
    runner.close()
    assert not runner.is_loaded()


def test_is_loaded_on_a_spec_loads_the_model_once(tiny_dirs: dict[str, Path]) -> None:
    runner = ss.TextLLMRunner(str(tiny_dirs["llama"]), max_context=64)
    assert not runner.is_loaded()
    model = runner.model  # loads
    assert runner.is_loaded() and runner.model is model
    runner.close()


# Row: get_vocab_size ---------------------------------------------------------------------


def test_get_vocab_size_is_the_model_s(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    assert runner.get_vocab_size() == tiny.info.vocab_size == 272  # not -1, as 1.5.1's
    assert runner.is_loaded()
    runner.close()


# Row: generate continues the conversation ------------------------------------------------


def test_generate_continues_after_the_conversation(tiny: ss.Model) -> None:
    """Both place a turn's prompt after the conversation, and after a turn hold its prompt
    and its decode steps' inputs (``pos = prompt + num_generated_tokens``). The turn's last
    sampled token, which no step fed, ExecuTorch drops; slotserve feeds it first in the
    next turn, so the model reads its whole reply."""
    runner = ss.TextLLMRunner(tiny, max_context=64)
    first = runner.generate([5, 6, 7], GREEDY)
    assert runner.position == 3 + first.stats.num_generated_tokens
    second = runner.generate([8, 9], GREEDY)
    assert second.stats.num_prompt_tokens == 1 + 2  # the last reply token, then the prompt
    assert second.tokens == one_shot(tiny, [5, 6, 7, *first.tokens, 8, 9])
    # Fed, and to be fed: every sampled token (ExecuTorch's would lack both last ones).
    assert runner.conversation == [5, 6, 7, *first.tokens, 8, 9, *second.tokens]
    assert runner.position == len(runner.conversation) - 1


# Row: the first token's sampling ---------------------------------------------------------


def test_the_first_token_is_sampled_with_the_config(tiny: ss.Model) -> None:
    """ExecuTorch's prefill takes the argmax, whatever ``temperature``; slotserve samples
    every token with the config: at temperature 1 some seeds start elsewhere."""
    greedy_first = one_shot(tiny, [5, 6, 7], GREEDY)[0]
    firsts = {
        one_shot(
            tiny,
            [5, 6, 7],
            GenerationConfig(echo=False, temperature=1.0, seed=seed, max_new_tokens=1),
        )[0]
        for seed in range(12)
    }
    assert firsts - {greedy_first}


# Rows: prefill, and generate after it ------------------------------------------------------


def test_prefill_adds_to_the_conversation_without_generating(tiny: ss.Model) -> None:
    """Encoded with ``num_bos``/``num_eos`` (no other field read), placed after the
    conversation, nothing shown, the stats untouched, None returned (as 1.5.1's binding)."""
    runner = ss.TextLLMRunner(tiny, max_context=64)
    stats_before = runner.stats
    assert runner.prefill("hi", GenerationConfig(num_bos=1, temperature=1.0)) is None
    hi = tiny.tokenizer.encode("hi", add_bos=False)
    assert runner.position == 1 + len(hi) == 3  # BOS + two byte tokens; nothing generated
    assert runner.stats is stats_before and runner.stats.inference_start_ms == 0
    assert runner.conversation == [tiny.tokenizer.bos_id, *hi]  # the prediction is not in it
    with pytest.raises(ValueError, match="prefill needs a prompt"):
        runner.prefill("")


def test_an_empty_prompt_after_prefill_starts_from_its_prediction(tiny: ss.Model) -> None:
    """The prediction (the greedy next token) is the first generated token, shown first;
    the turn equals one generation of the prefilled prompt."""
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.prefill([5, 6, 7])
    pieces: list[str] = []
    result = runner.generate("", GREEDY, token_callback=pieces.append)
    alone = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY)
    assert result.tokens == alone.tokens
    assert "".join(pieces) == result.text and pieces[0] == tiny.tokenizer.decode(
        result.tokens[:1], skip_special=True
    )
    # num_prompt_tokens: the prefilled positions (ExecuTorch reads pos_, after decoding).
    assert result.stats.num_prompt_tokens == 3
    assert result.stats.num_generated_tokens == len(result.tokens) - 1
    assert runner.position == 3 + len(result.tokens) - 1


def test_a_prompt_after_prefill_drops_its_prediction(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.prefill([5, 6, 7])
    result = runner.generate([8, 9], GREEDY)
    assert result.stats.num_prompt_tokens == 2  # no pending token fed
    assert result.tokens == one_shot(tiny, [5, 6, 7, 8, 9])


def test_successive_prefills_add_up(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.prefill([5, 6])
    runner.prefill([7])  # the first prediction is dropped, not fed
    runner.prefill([8, 9])
    assert runner.position == 5
    assert runner.generate([], GREEDY).tokens == one_shot(tiny, [5, 6, 7, 8, 9])


def test_prefill_after_a_turn_feeds_its_last_token_first(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    first = runner.generate([5, 6, 7], GREEDY)
    runner.prefill([8, 9])
    assert runner.position == 3 + len(first.tokens) + 2
    assert runner.generate([], GREEDY).tokens == one_shot(tiny, [5, 6, 7, *first.tokens, 8, 9])


def test_a_predicted_eos_ends_the_turn(tiny: ss.Model) -> None:
    """[4, 129]'s greedy next token is EOS. Prefill predicts it; the empty-prompt turn
    after it ends there (``ignore_eos`` decodes past it)."""
    until_eos = GenerationConfig(echo=False, temperature=0, max_new_tokens=8)
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.prefill([4, 129])
    result = runner.generate([], until_eos)
    assert (result.tokens, result.finish_reason) == ([], "stop")
    assert result.eos_token in tiny.tokenizer.eos_ids
    runner.reset()
    runner.prefill([4, 129])
    past = runner.generate([], GREEDY)
    assert past.tokens[0] in tiny.tokenizer.eos_ids and len(past.tokens) == 6


def test_prefill_that_leaves_no_room_is_refused(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=8)
    with pytest.raises(ss.ContextOverflow, match=r"prompt 8 tokens.*max_context=8"):
        runner.prefill(list(range(3, 11)))
    assert runner.position == 0
    runner.prefill(list(range(3, 10)))  # 7 of 8: one position left for the prediction
    assert runner.generate([], GenerationConfig(echo=False, temperature=0)).tokens


# Row: an empty prompt without prefill -----------------------------------------------------


def test_an_empty_prompt_without_prefill(tiny: ss.Model) -> None:
    """ExecuTorch refuses (``InvalidState``: an empty prompt needs a prior prefill).
    slotserve refuses on an empty conversation, and after a turn continues its reply."""
    runner = ss.TextLLMRunner(tiny, max_context=64)
    with pytest.raises(ValueError, match="nothing to continue"):
        runner.generate("", GREEDY)
    first = runner.generate([5, 6, 7], GREEDY)
    more = runner.generate([], GREEDY)
    assert more.stats.num_prompt_tokens == 1  # the last reply token, fed now
    assert more.tokens == one_shot(tiny, [5, 6, 7, *first.tokens])
    runner.reset()
    with pytest.raises(ValueError, match="nothing to continue"):
        runner.generate([], GREEDY)


# Row: stats per call --------------------------------------------------------------------


def test_each_generate_reports_its_own_stats(tiny: ss.Model) -> None:
    """ExecuTorch's runner keeps one `Stats`: its aggregates add up over calls until
    ``reset``. slotserve's ``generate`` returns each call's own (the load times kept)."""
    runner = ss.TextLLMRunner(tiny, max_context=64)
    first = runner.generate([5, 6, 7], GREEDY).stats
    second = runner.generate([8], GREEDY).stats
    assert second is not first and second is runner.stats
    assert second.inference_start_ms >= first.inference_end_ms
    assert second.num_generated_tokens == GREEDY.max_new_tokens - 1
    assert (second.model_load_start_ms, second.model_load_end_ms) == (
        first.model_load_start_ms,
        first.model_load_end_ms,
    )


# Row: reset --------------------------------------------------------------------------------


def test_reset_forgets_the_conversation_the_prediction_and_the_stats(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.generate([5, 6, 7], GREEDY)
    runner.prefill([8, 9])
    loaded = runner.stats.model_load_end_ms
    runner.reset()
    assert (runner.position, runner.conversation) == (0, [])
    assert runner.stats.model_load_end_ms == loaded and runner.stats.inference_start_ms == 0
    with pytest.raises(ValueError, match="nothing to continue"):
        runner.generate([], GREEDY)  # the prediction went with the conversation
