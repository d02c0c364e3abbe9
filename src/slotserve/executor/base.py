"""The executor contract: what the engine needs from whatever runs a model's steps."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore


class Executor(Protocol):
    """Runs one step: ``tokens[T]`` of ``batch`` over ``kv``; logits ``[B, vocab]`` of each
    sequence's last token, or with ``all_logits`` every token's ``[T, vocab]`` (a speculative
    step verifies its drafts on them). It reaches the KV only through the pool's
    ``update_and_attend``; the engine has validated and committed the step in the pool
    before the call.
    ``weight_bytes`` is what it keeps resident to do so (the engine's memory plan counts
    it); ``max_step_tokens`` the largest step it takes (None: any): the engine lowers a
    larger ``max_batch_tokens`` to it and refuses ``max_seqs`` above it."""

    @property
    def weight_bytes(self) -> int: ...

    @property
    def max_step_tokens(self) -> int | None: ...

    def step(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore, *, all_logits: bool = False
    ) -> torch.Tensor: ...


@runtime_checkable
class HiddenStates(Protocol):
    """An executor that can also return a step's final hidden states (embedding requests):
    ``hidden_step`` runs the step as ``step`` does and returns its logits ``[B, vocab]`` and
    the final-norm hidden states ``[T, dim]`` of every token on the step's axis."""

    @property
    def embeds(self) -> bool: ...  # whether hidden_step can run for this model

    def hidden_step(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
