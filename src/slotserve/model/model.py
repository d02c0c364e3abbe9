"""`Model`: what every executor shares about a loaded model (info, tokenizer, RoPE, source,
the kernels it was loaded with) and the layer halves that hold its weights."""

from __future__ import annotations

import logging
from typing import Any

import torch

from slotserve.info import ModelInfo
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.memory import MemoryLedger
from slotserve.model.block_forward import BlockHalves
from slotserve.model.halves import LayerHalves, run_layers
from slotserve.model.layers import RopeTables
from slotserve.model.llama import EagerHalves
from slotserve.model.weights import LlamaWeights
from slotserve.native import NO_KERNELS, Kernels
from slotserve.tokenizer import Tokenizer

_log = logging.getLogger("slotserve")


class Model:
    """A loaded model. Generation state lives in a KV store that the caller passes to every
    call, so one model can serve any number of sessions. ``halves`` run its layers
    (`slotserve.model.halves`); ``kernels`` are the compiled kernels it was loaded with
    (the engine's pool takes its attention kernel from them)."""

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Tokenizer,
        halves: LayerHalves[Any],
        source: str = "",
        kernels: Kernels = NO_KERNELS,
    ) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.halves = halves
        self.source = source
        self.kernels = kernels
        # The memory ledger `slotserve.load` marked this model's arenas in; None for a
        # model built another way (`slotserve.engine.probe.ledger_for`).
        self.ledger: MemoryLedger | None = None
        self.rope = RopeTables(info.rope, info.head_dim, info.max_context)
        self.local_rope = (
            RopeTables(info.rope_local, info.head_dim, info.max_context)
            if info.rope_local is not None
            else None
        )

    @classmethod
    def from_weights(
        cls,
        info: ModelInfo,
        tokenizer: Tokenizer,
        weights: LlamaWeights,
        source: str = "",
        kernels: Kernels = NO_KERNELS,
    ) -> Model:
        """The model on ``weights`` with the halves that run them fastest: the fused block
        halves where the block kernel is built and covers the model, else the eager ones
        (logged, with the reason)."""
        return cls(info, tokenizer, pick_halves(weights, info, kernels, source), source, kernels)

    @property
    def weights(self) -> LlamaWeights | None:
        """The loaded tensors (None for a bundle, whose weights live in its program)."""
        return self.halves.weights

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights."""
        return self.halves.weight_bytes

    def cover_positions(self, positions: int) -> None:
        """Build the RoPE rows of positions ``0 .. positions - 1`` now (an engine's
        ``max_context``: what its plan counts for them, `ModelInfo.rope_table_bytes`), so
        that no step's measured memory includes them."""
        for tables in (self.rope, self.local_rope):
            if tables is not None:
                tables.cover(positions)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits for the step: ``[B, vocab]`` (each sequence's last token) or, with
        ``all_logits``, ``[T, vocab]`` for every token on the flattened axis.

        The caller has committed ``batch`` in the KV store (`KVPool.begin_step`); the model
        only writes and attends through ``update_and_attend``."""
        if tokens.shape != (batch.n_tokens,):
            raise ValueError(f"tokens shape {tuple(tokens.shape)} != ({batch.n_tokens},)")
        if max(batch.ends) > self.info.max_context:
            raise ValueError(
                f"position {max(batch.ends)} exceeds the model's context {self.info.max_context}"
            )
        x = run_layers(
            self.halves, self.info.n_layers, self.rope, tokens, batch, kv, self.local_rope
        )
        if not all_logits:
            x = x[batch.last_token_rows()]
        return self.halves.head(x).float()

    def prefill(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """Append each sequence's prompt chunk; logits ``[B, vocab]`` of its last token."""
        return self.forward(tokens, batch, kv)

    def decode(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """Append one token per sequence; logits ``[B, vocab]``."""
        if batch.max_len != 1:
            raise ValueError(f"decode takes one token per sequence, got lengths {batch.lengths}")
        return self.forward(tokens, batch, kv)


def pick_halves(
    weights: LlamaWeights, info: ModelInfo, kernels: Kernels, source: str = ""
) -> LayerHalves[Any]:
    """Block halves where they can run ``weights``, else eager (see `Model.from_weights`)."""
    reason = BlockHalves.refusal(weights, info)
    if kernels.blocks is not None and reason is None:
        _log.info("%s: layer halves 'block' (fused C kernel calls)", source or info.arch)
        return BlockHalves(weights, info, kernels.blocks)
    if kernels.blocks is not None:
        _log.info("%s: layer halves 'eager' (block halves do not cover %s)", source, reason)
    return EagerHalves(weights, info)
