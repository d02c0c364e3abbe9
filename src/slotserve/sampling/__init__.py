"""Sampling: how each request picks its next token. `SamplingParams` (params.py) says how;
`RequestSampler` and the batched `sample_batch` (sampler.py) apply the chain of logit
transforms (logit bias → grammar mask → penalties → temperature → top-k → top-p → min-p →
draw) row by row, so constrained and free requests share a batch step; `GrammarCompiler`
(grammar.py) compiles JSON schemas and grammars into llguidance `Grammar`s whose
per-request `GrammarMatcher`s mask forbidden tokens, those from the network in a bounded
pool of worker processes (compile_pool.py); `StopMatcher` (stop.py) ends text at a stop
string without emitting any part of it. No module here keeps state of its own: a
compiler's tokenizer index belongs to whoever made the compiler.
"""

from slotserve.sampling.grammar import Grammar, GrammarCompiler, GrammarError, GrammarMatcher
from slotserve.sampling.params import (
    COSTLIEST_SAMPLING,
    MAX_LOGIT_BIAS,
    MIN_TEMPERATURE,
    SamplingParams,
)
from slotserve.sampling.sampler import (
    RequestSampler,
    apply_penalties,
    filter_probs,
    sample_batch,
    token_logprobs,
)
from slotserve.sampling.stop import StopMatcher

__all__ = [
    "COSTLIEST_SAMPLING",
    "MAX_LOGIT_BIAS",
    "MIN_TEMPERATURE",
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "RequestSampler",
    "SamplingParams",
    "StopMatcher",
    "apply_penalties",
    "filter_probs",
    "sample_batch",
    "token_logprobs",
]
