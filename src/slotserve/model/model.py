"""`Model`: weights + `ModelInfo` + tokenizer, with the pure ``prefill``/``decode`` methods."""

from __future__ import annotations

import functools

import torch

from slotserve.info import ModelInfo
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import KVConfig
from slotserve.kv.pool import KVPool
from slotserve.kv.store import KVStore
from slotserve.model.block_forward import BlockLayers
from slotserve.model.layers import RopeTables
from slotserve.model.llama import forward_hidden
from slotserve.model.weights import LlamaWeights
from slotserve.tokenizer import Tokenizer


class Model:
    """A loaded model. Holds weights only; generation state lives in a KV store that the
    caller passes to every call, so one model can serve any number of sessions.

    ``weights`` is None for a model whose weights all live in a lowered program (a bundle,
    `slotserve.artifact.bundle`): it describes the model (info, tokenizer, RoPE) for the
    engine, its executor runs the steps, and ``program_bytes`` is what the program keeps
    resident (its files' size)."""

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Tokenizer,
        weights: LlamaWeights | None,
        source: str = "",
        *,
        program_bytes: int = 0,
    ) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.weights = weights
        self.source = source
        self.program_bytes = program_bytes
        self.rope = RopeTables.build(info.rope, info.head_dim, info.max_context)

    @functools.cached_property
    def _block_layers(self) -> BlockLayers | None:
        """The fused forward's view of the weights, where it covers them."""
        return BlockLayers.of(self.weights, self.info) if self.weights is not None else None

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights: loaded tensors, or the lowered program's."""
        return self.weights.nbytes if self.weights is not None else self.program_bytes

    def require_weights(self) -> LlamaWeights:
        """The weights; a `ValueError` for a model whose weights live in a lowered program."""
        if self.weights is None:
            raise ValueError(
                f"{self.source or 'this model'}: its weights live in a lowered program (a "
                "bundle); run it with that program's executor (slotserve.executor.executor_for)"
            )
        return self.weights

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits for the step: ``[B, vocab]`` (each sequence's last token) or, with
        ``all_logits``, ``[T, vocab]`` for every token on the flattened axis.

        The caller has committed ``batch`` in the KV store (`KVPool.begin_step`); the model
        only writes and attends through ``update_and_attend``."""
        weights = self.require_weights()
        if tokens.shape != (batch.n_tokens,):
            raise ValueError(f"tokens shape {tuple(tokens.shape)} != ({batch.n_tokens},)")
        if max(batch.ends) > self.info.max_context:
            raise ValueError(
                f"position {max(batch.ends)} exceeds the model's context {self.info.max_context}"
            )
        if self._block_layers is not None:
            hidden = self._block_layers.forward_hidden(weights, self.rope, tokens, batch, kv)
        else:
            hidden = forward_hidden(weights, self.info, self.rope, tokens, batch, kv)
        if not all_logits:
            hidden = hidden[batch.last_token_rows()]
        return weights.lm_head(hidden).float()

    def prefill(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """Append each sequence's prompt chunk; logits ``[B, vocab]`` of its last token."""
        return self.forward(tokens, batch, kv)

    def decode(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """Append one token per sequence; logits ``[B, vocab]``."""
        if batch.max_len != 1:
            raise ValueError(f"decode takes one token per sequence, got lengths {batch.lengths}")
        return self.forward(tokens, batch, kv)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits ``[T, vocab]`` of ``token_ids`` from an empty context
        (entry i scores the token after ``token_ids[: i + 1]``)."""
        if not token_ids:
            raise ValueError("logits() needs at least one token")
        # A scratch pool this call owns and drives, as the engine drives its own.
        kv = KVPool(self.info, KVConfig(layout="flat", max_seqs=1, max_context=len(token_ids)))
        kv.reserve(0, len(token_ids))
        batch = StepBatch.single(0, len(token_ids))
        kv.begin_step(batch)
        return self.forward(torch.tensor(token_ids), batch, kv, all_logits=True)
