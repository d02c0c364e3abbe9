"""`TorchExecutor`: a loaded model's steps through its layer halves; `executor_for`."""

from __future__ import annotations

import torch

from slotserve.executor.base import Executor
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model import Model
from slotserve.model.halves import run_layers
from slotserve.model.layers import rms_norm


class TorchExecutor:
    """Runs ``model.forward``: the one loop over whichever halves the model was loaded with
    (eager torch ops, the fused block kernels, or a bundle's program methods on the
    ExecuTorch runtime, `slotserve.artifact.program`). What it keeps resident and the
    largest step it takes are the halves'."""

    def __init__(self, model: Model) -> None:
        self.model = model

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def max_step_tokens(self) -> int | None:
        return self.model.halves.max_step_tokens

    def step(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore, *, all_logits: bool = False
    ) -> torch.Tensor:
        """The step's logits: each sequence's last token's, or with ``all_logits`` every
        token's ``[T, vocab]`` (a speculative step verifies its drafts on them)."""
        return self.model.forward(tokens, batch, kv, all_logits=all_logits)

    @property
    def embeds(self) -> bool:
        """Whether `hidden_step` can run: the final norm's weights are at hand (a bundle's
        live inside its head method)."""
        return self.model.weights is not None

    @torch.inference_mode()
    def hidden_step(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step`'s logits, and the final-norm hidden states ``[T, dim]`` of every token
        (`executor.base.HiddenStates`): the one loop, then the final norm of every row and
        the head of each sequence's last row, as `Model.forward` computes them."""
        model, weights = self.model, self.model.weights
        if weights is None:
            raise ValueError("this model's final norm lives in its program: it cannot embed")
        hidden = run_layers(
            model.halves, model.info.n_layers, model.rope, tokens, batch, kv, model.local_rope
        )
        logits = model.halves.head(hidden[batch.last_token_rows()]).float()
        return logits, rms_norm(hidden, weights.norm, model.info.norm_eps).float()


def executor_for(model: Model) -> Executor:
    """The executor that runs ``model``, whatever its halves (a bundle's included: its
    program was loaded, checked and sized by `slotserve.load`)."""
    return TorchExecutor(model)
