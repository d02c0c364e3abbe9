"""`GenerationConfig`'s prompt options on `TextLLMRunner` (the runner over this engine):
``num_bos``/``num_eos`` wrap a text prompt's ids, as ExecuTorch's tokenizer call does;
``echo`` hands a text prompt to the token callback first. A prompt of token ids is fed as
given: no BOS/EOS is added and nothing is echoed (there is no text to echo)."""

from __future__ import annotations

from dataclasses import replace

import slotserve as ss
from slotserve.runner import GenerationConfig

GREEDY = GenerationConfig(echo=False, temperature=0, max_new_tokens=6, ignore_eos=True)


def test_num_eos_appends_eos_ids_to_a_text_prompt(tiny: ss.Model) -> None:
    eos = tiny.tokenizer.eos_ids[0]
    ids = tiny.tokenizer.encode("hi", add_bos=False)
    text = ss.TextLLMRunner(tiny, max_context=64)
    with_eos = text.generate("hi", replace(GREEDY, num_eos=2))
    assert with_eos.stats.num_prompt_tokens == len(ids) + 2
    assert text.position == len(ids) + 2 + len(with_eos.tokens) - 1  # the last is pending
    # The same tokens as the explicit ids with two EOS at the end: they were appended.
    explicit = ss.TextLLMRunner(tiny, max_context=64).generate([*ids, eos, eos], GREEDY)
    assert with_eos.tokens == explicit.tokens
    plain = ss.TextLLMRunner(tiny, max_context=64).generate("hi", GREEDY)
    assert plain.stats.num_prompt_tokens == len(ids)


def test_bos_and_eos_counts_leave_token_prompts_as_given(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    config = replace(GREEDY, num_bos=1, num_eos=2)
    result = runner.generate([5, 6, 7], config)
    assert result.stats.num_prompt_tokens == 3
    alone = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY)
    assert result.tokens == alone.tokens


def test_echo_hands_a_text_prompt_first_and_token_prompts_nothing(tiny: ss.Model) -> None:
    echo = replace(GREEDY, echo=True)
    pieces: list[str] = []
    text = ss.TextLLMRunner(tiny, max_context=64).generate("hi", echo, pieces.append)
    assert pieces[0] == "hi" and "".join(pieces[1:]) == text.text
    pieces.clear()
    tokens = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], echo, pieces.append)
    assert "".join(pieces) == tokens.text  # only the generated text
    pieces.clear()
    quiet = ss.TextLLMRunner(tiny, max_context=64).generate("hi", GREEDY, pieces.append)
    assert "".join(pieces) == quiet.text  # echo=False: no prompt
