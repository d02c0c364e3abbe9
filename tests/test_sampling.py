"""Sampler transforms, seeding, and stop-string streaming."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import llguidance
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.sampling import (
    GrammarCompiler,
    GrammarError,
    RequestSampler,
    SamplingParams,
    StopMatcher,
    apply_penalties,
    filter_probs,
    sample_batch,
)
from slotserve.sampling.cpu import greedy_tokens
from slotserve.testing import TINY_VOCAB, tiny_tokenizer
from slotserve.tokenizer import Tokenizer


def test_greedy_takes_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert RequestSampler(SamplingParams(temperature=0), 4).sample(logits) == 1


@settings(deadline=None)  # the first call's timing follows the machine's load, not the code
@given(
    st.integers(1, 12).flatmap(
        lambda width: st.lists(
            st.lists(
                st.sampled_from([-1.5, 0.0, 2.0, float("inf"), float("-inf"), float("nan")]),
                min_size=width,
                max_size=width,
            ),
            min_size=1,
            max_size=5,
        )
    )
)
def test_greedy_tokens_are_torch_argmax_ties_and_nans_included(rows: list[list[float]]) -> None:
    """The numpy path picks what torch's argmax picks: the first of equal values, and a
    NaN over everything; a strided view (torch's own path) gives the same answer."""
    logits = torch.tensor(rows, dtype=torch.float32)
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
    strided = torch.stack([logits, logits], dim=-1)[..., 0]  # a view of stride 2
    assert greedy_tokens(strided) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def draw(seed: int) -> list[int]:
        sampler = RequestSampler(SamplingParams(temperature=1.5, seed=seed), 1000)
        return [sampler.sample(logits) for _ in range(30)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_top_k_keeps_k() -> None:
    probs = torch.softmax(torch.arange(10.0), -1)
    kept = filter_probs(probs, SamplingParams(top_k=3))
    assert (kept > 0).nonzero().flatten().tolist() == [7, 8, 9]


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_probs(probs, SamplingParams(top_p=0.7))
    assert (kept > 0).tolist() == [True, True, False, False]
    kept = filter_probs(probs, SamplingParams(top_p=0.1))
    assert (kept > 0).tolist() == [True, False, False, False]


def test_min_p_relative_to_top() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    kept = filter_probs(probs, SamplingParams(min_p=0.2))
    assert (kept > 0).tolist() == [True, True, False, False]


def test_sampling_only_draws_allowed_tokens() -> None:
    logits = torch.arange(50.0) / 10
    sampler = RequestSampler(SamplingParams(temperature=1.0, top_k=2, seed=3), 50)
    assert {sampler.sample(logits) for _ in range(100)} == {48, 49}


def test_repetition_penalty_follows_hf_rule() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    seen = torch.tensor([True, True, False])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), seen, torch.zeros(3))
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties() -> None:
    counts = torch.tensor([0.0, 1.0, 3.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(torch.zeros(3), params, counts > 0, counts)
    assert out.tolist() == [0.0, -0.75, -1.25]


def test_batch_sampling_records_tokens() -> None:
    samplers = [RequestSampler(SamplingParams(temperature=0), 4) for _ in range(2)]
    tokens = sample_batch(torch.tensor([[0.0, 1.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]]), samplers)
    assert tokens == [1, 0]
    assert samplers[0].generated_counts[1] == 1 and samplers[1].seen[0]


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("max_new_tokens", -1)],
)
def test_invalid_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_must_be_a_tuple_of_strings() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="x")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc\n", max_size=30),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(1, 5), min_size=1, max_size=30),
)
def test_stop_strings_are_never_emitted(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopMatcher(stops)
    emitted, position, stopped = [], 0, False
    for cut in [*cuts, len(text)]:
        piece = text[position : position + cut]
        position += cut
        out, stopped = matcher.push(piece)
        emitted.append(out)
        if stopped or position >= len(text):
            break
    if not stopped:
        emitted.append(matcher.flush())
    result = "".join(emitted)
    assert not any(s in result for s in stops)
    if stopped:
        # The output is the text up to where a stop string begins, nothing of it after.
        assert text.startswith(result)
        assert any(text[len(result) :].startswith(s) for s in stops)
    else:
        consumed = text[: min(position, len(text))]
        assert result == consumed
        assert not any(s in consumed for s in stops)


def test_degenerate_distributions_fall_back_to_greedy() -> None:
    tiny_temperature = RequestSampler(SamplingParams(temperature=1e-300, seed=1), 4)
    assert tiny_temperature.params.greedy
    assert tiny_temperature.sample(torch.tensor([0.0, 5.0, 1.0, 2.0])) == 1
    with_inf = RequestSampler(SamplingParams(temperature=1.0, seed=1), 3)
    assert with_inf.sample(torch.tensor([0.0, float("inf"), 1.0])) == 1


def test_seed_must_fit_64_bits() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)


# --- logit bias and grammar constraints -------------------------------------------------

TINY_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"const": "point"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["kind", "color", "name", "x"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """The tiny models' byte-level tokenizer (259 tokens, end-of-sequence id 2)."""
    return Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=[2], chat_template=None)


@pytest.fixture(scope="module")
def compiler(byte_tokenizer: Tokenizer) -> GrammarCompiler:
    """Grammars over the byte tokenizer's logits (its llguidance index built once)."""
    return GrammarCompiler(byte_tokenizer, TINY_VOCAB)


def test_logit_bias_removes_and_forces_tokens() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, -1.0])
    banned = RequestSampler(SamplingParams(temperature=0, logit_bias=((1, -100.0),)), 4)
    assert banned.sample(logits) == 2
    forced = RequestSampler(SamplingParams(temperature=1.0, logit_bias=((3, 100.0),)), 4)
    assert {forced.sample(logits) for _ in range(50)} == {3}
    assert logits.tolist() == [0.0, 3.0, 2.5, -1.0]  # the caller's logits are untouched


@pytest.mark.parametrize("bias", [((0, 100.5),), ((0, -101.0),), ((-1, 1.0),)])
def test_logit_bias_values_are_checked(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_names_it() -> None:
    with pytest.raises(ValueError, match=r"token id 9 .*0\.\.3"):
        RequestSampler(SamplingParams(logit_bias=((9, 1.0),)), 4)


def test_unsupported_schema_keyword_is_named(compiler: GrammarCompiler) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems"):
        compiler.json_schema(schema)


def test_a_compiler_builds_its_tokenizer_index_once(
    byte_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grammars compiled at once from many threads share one llguidance tokenizer index."""
    built: list[int] = []
    real = llguidance.LLTokenizer

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", counting)
    compiler = GrammarCompiler(byte_tokenizer, TINY_VOCAB)
    with ThreadPoolExecutor(8) as pool:
        grammars = list(pool.map(compiler.json_schema, [TINY_SCHEMA, None] * 8))
    assert len(built) == 1
    first = [grammar.matcher(TINY_VOCAB).allowed() for grammar in grammars]
    assert all(
        byte_tokenizer.decode(allowed.nonzero().flatten().tolist()) == "{" for allowed in first
    )


def test_grammar_must_match_the_logits_width(compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema(None)
    with pytest.raises(ValueError, match="vocab_size"):
        RequestSampler(SamplingParams(grammar=grammar), TINY_VOCAB + 1)


def test_constrained_and_free_rows_share_a_batch(
    byte_tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    """Each row keeps its own rule: the free row is the plain argmax, the constrained row
    starts the JSON object, and the caller's logits are not changed."""
    grammar = compiler.json_schema(TINY_SCHEMA)
    logits = torch.randn(2, TINY_VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    free = RequestSampler(SamplingParams(temperature=0), TINY_VOCAB)
    constrained = RequestSampler(SamplingParams(temperature=0, grammar=grammar), TINY_VOCAB)
    tokens = sample_batch(logits, [free, constrained])
    assert tokens[0] == int(before[0].argmax())
    assert byte_tokenizer.decode([tokens[1]]) == "{"
    assert torch.equal(logits, before)


def _run_constrained(
    sampler: RequestSampler, seed: int, eos: int, limit: int
) -> tuple[list[int], bool]:
    """Draw up to ``limit`` tokens from random logits; (tokens before EOS, reached EOS)."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(limit):
        # Spiky logits, like a model's: the mask must hold against strong preferences.
        logits = torch.randn(TINY_VOCAB, generator=generator) * 4
        token = sample_batch(logits.unsqueeze(0), [sampler])[0]
        if token == eos:
            return tokens, True
        tokens.append(token)
    return tokens, False


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), temperature=st.sampled_from([0.0, 0.8, 1.5]))
def test_constrained_output_is_always_valid_json(
    byte_tokenizer: Tokenizer, compiler: GrammarCompiler, seed: int, temperature: float
) -> None:
    """Whatever the logits say, the grammar's state advances with each drawn token and the
    output is valid: complete JSON that validates when the request ended at EOS, and always
    a prefix of such a document (the schema bounds its length, so EOS comes in time)."""
    grammar = compiler.json_schema(TINY_SCHEMA)
    params = SamplingParams(temperature=temperature, top_k=40, seed=seed, grammar=grammar)
    sampler = RequestSampler(params, TINY_VOCAB)
    tokens, ended = _run_constrained(sampler, seed, eos=2, limit=120)
    assert sampler.matcher is not None and sampler.matcher.error is None
    assert ended, byte_tokenizer.decode(tokens)
    document = json.loads(byte_tokenizer.decode(tokens))
    jsonschema.validate(document, TINY_SCHEMA)


def test_any_json_object_mode(byte_tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema(None)
    sampler = RequestSampler(SamplingParams(temperature=0, grammar=grammar), TINY_VOCAB)
    # Steer the free-form object shut: bias towards "}" so that it ends, as a model would.
    close = byte_tokenizer.encode("}")[0]
    generator = torch.Generator().manual_seed(1)
    tokens: list[int] = []
    while len(tokens) < 200:
        logits = torch.randn(TINY_VOCAB, generator=generator)
        logits[close] += 6.0
        token = sampler.sample(logits)
        if token == 2:
            break
        sampler.accept(token)
        tokens.append(token)
    assert isinstance(json.loads(byte_tokenizer.decode(tokens)), dict)


def test_a_forbidden_token_ends_the_request(
    byte_tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    """A token drawn around the mask puts the matcher in error; from then on only EOS."""
    grammar = compiler.json_schema(TINY_SCHEMA)
    sampler = RequestSampler(SamplingParams(temperature=0, grammar=grammar), TINY_VOCAB)
    sampler.accept(byte_tokenizer.encode("x")[0])
    assert sampler.matcher is not None and sampler.matcher.error is not None
    assert sampler.sample(torch.randn(TINY_VOCAB)) == 2
